//! `PyO3` bindings: argument conversion, GIL release, error mapping. No decisions live here.
//! The engine here; host buffers and the module's functions in `py/`.

mod functions;
mod host_buffer;
mod route;

use functions::{
    chunk_blocks, chunk_count, chunk_skip, cuda_device_pointer, cuda_memcpy, cuda_memory_kind,
    cuda_pin, cuda_status, cuda_unpin, launch_plan, stage_slot, table_incompatibility,
};
use host_buffer::PyHostBuffer;
use route::{launch_with, route_candidates, PyRoute};

use std::sync::Arc;

use numpy::{PyArrayDescrMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::backend::cuda::{self, CudaBackend, CudaOptions};
use crate::backend::host::HostBackend;
use crate::backend::Backend;
use crate::descriptor::{Batch, DescriptorError};
use crate::direction::Direction;
use crate::engine::{self, Engine, EngineConfig, EngineError, GroupIds};
use crate::hostmem::{self, HostBuffer, HostBufferError, Pinner};
use crate::kernel::{KernelBatch, KernelLauncher, KernelParam, KernelSpec, PageKernel};
use crate::plan::{choice, Plan};
use crate::pool::PoolError;
use crate::region::MemoryKind;
use crate::table;
use crate::transfer::TransferResult;

create_exception!(
    blockswap,
    BlockswapError,
    PyException,
    "Base of every blockswap error."
);
create_exception!(
    blockswap,
    InvalidTransferError,
    BlockswapError,
    "A transfer, registration or engine setting refused before anything was issued: bad \
     descriptors, addresses outside registered memory, overlapping destinations, a live job id, \
     a setting outside its limits."
);
create_exception!(
    blockswap,
    PoolExhaustedError,
    BlockswapError,
    "No descriptor slab or in-flight slot is free: poll get_finished, or raise the limits."
);
create_exception!(
    blockswap,
    BackendError,
    BlockswapError,
    "The backend failed or is unavailable (no driver, a driver error, a forked process)."
);
create_exception!(
    blockswap,
    ShutdownError,
    BlockswapError,
    "The engine is shut down."
);
create_exception!(
    blockswap,
    WaitTimeoutError,
    BlockswapError,
    "wait() ran out of time; the transfers are still in flight."
);

impl From<EngineError> for PyErr {
    fn from(e: EngineError) -> PyErr {
        let msg = e.to_string();
        match e {
            EngineError::Descriptor(_)
            | EngineError::Config(_)
            | EngineError::Region(_)
            | EngineError::Table(_)
            | EngineError::JobIdLive(_)
            | EngineError::Pool(PoolError::TooLarge { .. } | PoolError::ExceedsCap { .. }) => {
                InvalidTransferError::new_err(msg)
            }
            EngineError::Pool(PoolError::Backend(_)) | EngineError::Backend(_) => {
                BackendError::new_err(msg)
            }
            EngineError::Pool(_) | EngineError::TooManyInFlight { .. } => {
                PoolExhaustedError::new_err(msg)
            }
            EngineError::Timeout { .. } => WaitTimeoutError::new_err(msg),
            EngineError::ShutDown => ShutdownError::new_err(msg),
        }
    }
}

impl From<HostBufferError> for PyErr {
    fn from(e: HostBufferError) -> PyErr {
        match e {
            HostBufferError::Size(_) | HostBufferError::InUse { .. } => {
                InvalidTransferError::new_err(e.to_string())
            }
            HostBufferError::Backend(b) => EngineError::Backend(b).into(),
        }
    }
}

fn invalid(msg: impl Into<String>) -> PyErr {
    InvalidTransferError::new_err(msg.into())
}

/// The outcome of one transfer.
#[pyclass(
    name = "TransferResult",
    module = "blockswap._core",
    frozen,
    get_all,
    eq
)]
#[derive(Clone, PartialEq)]
struct PyTransferResult {
    job_id: u64,
    success: bool,
    bytes: u64,
    seconds: f64,
    error: Option<String>,
}

#[pymethods]
impl PyTransferResult {
    fn __repr__(&self) -> String {
        format!(
            "TransferResult(job_id={}, success={}, bytes={}, seconds={:.3e}{})",
            self.job_id,
            if self.success { "True" } else { "False" },
            self.bytes,
            self.seconds,
            self.error
                .as_ref()
                .map(|e| format!(", error={e:?}"))
                .unwrap_or_default()
        )
    }
}

impl From<TransferResult> for PyTransferResult {
    fn from(r: TransferResult) -> Self {
        PyTransferResult {
            job_id: r.job_id,
            success: r.success,
            bytes: r.bytes,
            seconds: r.seconds,
            error: r.error,
        }
    }
}

/// Copies an int64 (or int32) array into owned memory as the u64 addresses, sizes or ids it
/// carries.
///
/// The copy is what gets validated and used: the caller's array is not read again once the GIL
/// is released, where another Python thread could write to it between the check and the use (a
/// validated address or block id swapped for one that was never checked).
fn copy_u64<T: numpy::Element + Copy + Into<i64>>(
    name: &str,
    a: &PyReadonlyArray1<'_, T>,
) -> PyResult<Vec<u64>> {
    let s = a
        .as_slice()
        .map_err(|_| invalid(format!("{name} must be a contiguous array")))?;
    // Negative values become huge ones, which validation refuses by name.
    Ok(s.iter().map(|&v| v.into() as u64).collect())
}

/// Block ids as a transfer names them: int64, or int32 as vLLM's specs hold them (taken as they
/// are, with no conversion on the caller's thread).
enum BlockIds<'py> {
    I64(PyReadonlyArray1<'py, i64>),
    I32(PyReadonlyArray1<'py, i32>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for BlockIds<'py> {
    type Error = PyErr;

    /// The dtype is looked at first: a failed extraction builds (and a derived enum formats) an
    /// error, which cost 19 µs a transfer where it was tried first on int32 ids.
    fn extract(ob: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(a) = ob.cast::<PyUntypedArray>() {
            if a.dtype().is_equiv_to(&numpy::dtype::<i32>(ob.py())) {
                return Ok(BlockIds::I32(ob.extract()?));
            }
        }
        Ok(BlockIds::I64(ob.extract()?))
    }
}

impl BlockIds<'_> {
    /// The ids as [`copy_u64`] copies them.
    fn copy(&self, name: &str) -> PyResult<Vec<u64>> {
        match self {
            BlockIds::I64(a) => copy_u64(name, a),
            BlockIds::I32(a) => copy_u64(name, a),
        }
    }
}

fn direction(s: &str) -> PyResult<Direction> {
    Direction::parse(s).ok_or_else(|| {
        invalid(format!(
            "direction must be 'h2d', 'd2h', 'h2h' or 'd2d', not {s:?}"
        ))
    })
}

/// Calls a Python kernel launcher (re-taking the GIL) for a transfer's kernel part.
fn call_launcher(launcher: &Py<PyAny>, b: KernelBatch) -> Result<(), String> {
    Python::attach(|py| {
        launcher
            .call1(
                py,
                (
                    b.src,
                    b.dst,
                    b.size,
                    b.len,
                    b.max_size,
                    b.alignment,
                    b.stream,
                ),
            )
            .map(drop)
            .map_err(|e| e.to_string())
    })
}

/// Moves batches of (src, dst, size) blocks on a backend. See the Python docs of `Engine`.
#[pyclass(name = "Engine", module = "blockswap._core", frozen)]
struct PyEngine {
    // Boxed: the engine's lock-free queues are cache-line aligned (128 bytes), more than the
    // 16 bytes Python's allocator gives the object PyO3 writes this struct into. Held inline,
    // every access would be a misaligned reference (debug builds abort on the first one).
    engine: Box<Engine>,
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(signature = (backend = "auto", *, device = 0, max_in_flight = 1024, pool_bytes = 268435456,
        max_descriptors = None, coalesce = true, shutdown_timeout = 60.0, copy_path = "auto",
        max_batch = None, timing = false, completion = "auto", h2d_order = "any",
        d2h_order = "stream", h2d_stream = None, d2h_stream = None,
        stage_bytes = 16777216, idle_issue = false, early_wake = true))]
    // The Python signature's keyword arguments, one parameter each (its flags among them).
    #[allow(clippy::too_many_arguments, clippy::fn_params_excessive_bools)]
    fn new(
        py: Python<'_>,
        backend: &str,
        device: i32,
        max_in_flight: i128,
        pool_bytes: i128,
        max_descriptors: Option<i128>,
        coalesce: bool,
        shutdown_timeout: f64,
        copy_path: &str,
        max_batch: Option<usize>,
        timing: bool,
        completion: &str,
        h2d_order: &str,
        d2h_order: &str,
        h2d_stream: Option<u64>,
        d2h_stream: Option<u64>,
        stage_bytes: i128,
        idle_issue: bool,
        early_wake: bool,
    ) -> PyResult<Self> {
        let config = EngineConfig::from_settings(
            max_in_flight,
            pool_bytes,
            max_descriptors,
            coalesce,
            shutdown_timeout,
        )
        .and_then(|c| c.stage_bytes(stage_bytes))
        .map_err(EngineError::from)?;
        let want_cuda = crate::backend::is_cuda(backend).map_err(invalid)?;
        // Parsed on every backend, so that a misspelt option is refused on machines without a
        // GPU too.
        let mut opts = CudaOptions::new(device);
        opts.copy_path = copy_path.parse().map_err(invalid)?;
        if let Some(m) = max_batch {
            if m == 0 {
                return Err(invalid(
                    "max_batch must be at least 1 (copies in one driver call), not 0",
                ));
            }
            opts.max_batch = m;
        }
        opts.timing = timing;
        opts.completion = completion.parse().map_err(invalid)?;
        // The parse error names the kind of setting; the argument is named here.
        let order = |name: &str, value: &str| {
            value
                .parse()
                .map_err(|e| invalid(format!("{name} (source access order) {e}")))
        };
        opts.access_order[Direction::HostToDevice.lane()] = order("h2d_order", h2d_order)?;
        opts.access_order[Direction::DeviceToHost.lane()] = order("d2h_order", d2h_order)?;
        opts.streams[Direction::HostToDevice.lane()] = h2d_stream;
        opts.streams[Direction::DeviceToHost.lane()] = d2h_stream;
        opts.max_in_flight = config.max_in_flight;
        opts.idle_issue = idle_issue;
        opts.early_wake = early_wake;
        let backend: Arc<dyn Backend> = if want_cuda {
            let b = py
                .detach(|| CudaBackend::new(opts))
                .map_err(EngineError::from)?;
            Arc::new(b)
        } else {
            Arc::new(HostBackend::new())
        };
        Ok(PyEngine {
            engine: Box::new(Engine::try_new(backend, config)?),
        })
    }

    /// Issues one transfer under `job_id` and returns at once.
    ///
    /// With `launcher` and `kernel_below`, the descriptors smaller than `kernel_below` bytes
    /// (after coalescing) are moved by `launcher(src_col, dst_col, size_col, n, max_size,
    /// alignment, stream)`, which must launch a copy kernel on the raw `stream` reading the
    /// descriptor columns in place; the rest go to DMA. One submission, one completion.
    #[pyo3(signature = (job_id, src_ptrs, dst_ptrs, sizes, direction = "h2d", wait_stream = None,
        kernel_below = 0, launcher = None))]
    // The Python signature's keyword arguments, one parameter each.
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        py: Python<'_>,
        job_id: u64,
        src_ptrs: PyReadonlyArray1<'_, i64>,
        dst_ptrs: PyReadonlyArray1<'_, i64>,
        sizes: PyReadonlyArray1<'_, i64>,
        direction: &str,
        wait_stream: Option<u64>,
        kernel_below: u64,
        launcher: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        let dir = self::direction(direction)?;
        let (s, d, z) = (
            copy_u64("src_ptrs", &src_ptrs)?,
            copy_u64("dst_ptrs", &dst_ptrs)?,
            copy_u64("sizes", &sizes)?,
        );
        if s.len() != d.len() || s.len() != z.len() {
            return Err(EngineError::from(DescriptorError::LengthMismatch {
                src: s.len(),
                dst: d.len(),
                size: z.len(),
            })
            .into());
        }
        let launch = |b: KernelBatch| call_launcher(launcher.as_ref().expect("routed"), b);
        let kernel = (launcher.is_some() && kernel_below > 0).then_some((
            kernel_below,
            PageKernel::Launcher(&launch as KernelLauncher<'_>),
        ));
        py.detach(|| {
            self.engine.submit_routed(
                job_id,
                Batch {
                    src: &s,
                    dst: &d,
                    size: &z,
                },
                dir,
                wait_stream,
                kernel,
            )
        })
        .map_err(Into::into)
    }

    /// Registers a block table (one side of a KV cache: segment `s` of block `b` is `nbytes[s]`
    /// bytes at `bases[s] + b * strides[s]`), checked once against registered `kind` memory.
    /// Returns its id for `submit_blocks`.
    #[pyo3(signature = (bases, strides, nbytes, num_blocks, kind, name = "", unit = 1))]
    // The Python signature's keyword arguments, one parameter each.
    #[allow(clippy::too_many_arguments)]
    fn register_table(
        &self,
        py: Python<'_>,
        bases: PyReadonlyArray1<'_, i64>,
        strides: PyReadonlyArray1<'_, i64>,
        nbytes: PyReadonlyArray1<'_, i64>,
        num_blocks: u64,
        kind: &str,
        name: &str,
        unit: u64,
    ) -> PyResult<u32> {
        let kind = MemoryKind::parse(kind)
            .ok_or_else(|| invalid(format!("kind must be 'host' or 'device', not {kind:?}")))?;
        let b = copy_u64("bases", &bases)?;
        let st = copy_u64("strides", &strides)?;
        let n = copy_u64("nbytes", &nbytes)?;
        // Every binding that takes the engine lock lets go of the GIL first: a submit holding the
        // lock may be waiting for the GIL (a Python launcher), and would wait forever.
        py.detach(|| {
            self.engine
                .register_table(table::TableSpec::new(b, st, n, num_blocks, kind).named(name, unit))
        })
        .map_err(Into::into)
    }

    fn unregister_table(&self, py: Python<'_>, table: u32) -> PyResult<()> {
        py.detach(|| self.engine.unregister_table(table))
            .map_err(Into::into)
    }

    /// Issues the transfer of blocks `src_ids` of table `src_table` to blocks `dst_ids` of
    /// `dst_table` (int64 arrays): ids checked against the tables, destinations distinct,
    /// descriptors written by the core. Routing as for `submit`.
    #[pyo3(signature = (job_id, src_table, src_ids, dst_table, dst_ids, direction = "h2d",
        wait_stream = None, kernel_below = 0, launcher = None))]
    // The Python signature's keyword arguments, one parameter each.
    #[allow(clippy::too_many_arguments)]
    fn submit_blocks(
        &self,
        py: Python<'_>,
        job_id: u64,
        src_table: u32,
        src_ids: PyReadonlyArray1<'_, i64>,
        dst_table: u32,
        dst_ids: PyReadonlyArray1<'_, i64>,
        direction: &str,
        wait_stream: Option<u64>,
        kernel_below: u64,
        launcher: Option<Py<PyAny>>,
    ) -> PyResult<()> {
        let dir = self::direction(direction)?;
        let (s, d) = (
            copy_u64("src_ids", &src_ids)?,
            copy_u64("dst_ids", &dst_ids)?,
        );
        let launch = |b: KernelBatch| call_launcher(launcher.as_ref().expect("routed"), b);
        let kernel = (launcher.is_some() && kernel_below > 0).then_some((
            kernel_below,
            PageKernel::Launcher(&launch as KernelLauncher<'_>),
        ));
        py.detach(|| {
            self.engine.submit_blocks(
                job_id,
                GroupIds::blocks(src_table, &s, dst_table, &d),
                dir,
                wait_stream,
                kernel,
            )
        })
        .map_err(Into::into)
    }

    /// Issues the transfer of blocks `src_ids` of table `src_table` to blocks `dst_ids` of
    /// `dst_table` as the pair's block plan: one 2-D copy per (block, run of segments at one
    /// pitch), copy engines only. Ids checked as for `submit_blocks`.
    #[pyo3(signature = (job_id, src_table, src_ids, dst_table, dst_ids, direction = "h2d",
        wait_stream = None))]
    // The Python signature's keyword arguments, one parameter each.
    #[allow(clippy::too_many_arguments)]
    fn submit_block_runs(
        &self,
        py: Python<'_>,
        job_id: u64,
        src_table: u32,
        src_ids: PyReadonlyArray1<'_, i64>,
        dst_table: u32,
        dst_ids: PyReadonlyArray1<'_, i64>,
        direction: &str,
        wait_stream: Option<u64>,
    ) -> PyResult<()> {
        let dir = self::direction(direction)?;
        let (s, d) = (
            copy_u64("src_ids", &src_ids)?,
            copy_u64("dst_ids", &dst_ids)?,
        );
        py.detach(|| {
            self.engine.submit_block_runs(
                job_id,
                GroupIds::blocks(src_table, &s, dst_table, &d),
                dir,
                wait_stream,
            )
        })
        .map_err(Into::into)
    }

    /// Announces a transfer about to be submitted on `direction` (see `Engine::wake`).
    fn wake(&self, py: Python<'_>, direction: &str) -> PyResult<()> {
        let dir = self::direction(direction)?;
        // Detached: the wake takes the lane's queue lock, which the lane's thread holds briefly.
        py.detach(|| self.engine.wake(dir));
        Ok(())
    }

    /// Issues one transfer of several KV-cache groups as one batch: `groups` holds one
    /// `(src_table, src_ids, dst_table, dst_ids, chunks)` per group (int64 or int32 id arrays;
    /// `chunks`: None, or the sub-blocks skipped in the first chunk where the side whose table
    /// has `unit` > 1 is named by chunk ids). A group may be empty. `route`: how it moves (a
    /// `Route`; None: a descriptor per page, by the copy engines).
    #[pyo3(signature = (job_id, groups, direction = "h2d", wait_stream = None, route = None))]
    // `groups` is the Python list of 5-tuples as pyo3 extracts it.
    #[allow(clippy::type_complexity)]
    fn submit_groups(
        &self,
        py: Python<'_>,
        job_id: u64,
        groups: Vec<(u32, BlockIds<'_>, u32, BlockIds<'_>, Option<u64>)>,
        direction: &str,
        wait_stream: Option<u64>,
        route: Option<Py<PyRoute>>,
    ) -> PyResult<()> {
        let dir = self::direction(direction)?;
        let mut ids = Vec::with_capacity(groups.len());
        for (_, src_ids, _, dst_ids, _) in &groups {
            ids.push((src_ids.copy("src_ids")?, dst_ids.copy("dst_ids")?));
        }
        let gs: Vec<GroupIds<'_>> = groups
            .iter()
            .zip(&ids)
            .map(|((src_table, _, dst_table, _, chunks), (s, d))| GroupIds {
                src_table: *src_table,
                src_ids: s,
                dst_table: *dst_table,
                dst_ids: d,
                chunks: *chunks,
            })
            .collect();
        py.detach(|| {
            let route = route.as_ref().map(Py::get);
            let launch = |b: KernelBatch| launch_with(route.expect("a launcher's route"), b);
            let core = route.map_or(Plan::Pages(None), |r| r.core(&launch as KernelLauncher<'_>));
            self.engine
                .submit_groups(job_id, &gs, dir, wait_stream, core)
        })
        .map_err(Into::into)
    }

    /// Makes a compiled copy kernel launchable by the core for staged plans (`submit_groups(...,
    /// staged=True, kernel=id)`): `function` a `CUfunction` loaded in the device's primary
    /// context (Triton's compiled kernel), `threads` per CTA, `shared` bytes of dynamic shared
    /// memory, `params` the names of its leading parameters (`srcs`, `dsts`, `sizes`, `count`,
    /// `split`, `src_base`, `dst_base`; any after them are passed as null pointers), `rows`
    /// descriptors per CTA step and `ctas` the most CTAs; `chained`: a staged kernel built for
    /// programmatic dependent launch (see `KernelSpec::chained`). Returns the kernel's id, or
    /// None on the host backend (which copies with memcpy).
    #[pyo3(signature = (
        function, threads, shared, params, rows, ctas, row_bytes = 0, chained = false
    ))]
    // The Python signature's keyword arguments, one parameter each.
    #[allow(clippy::too_many_arguments)]
    fn load_kernel(
        &self,
        py: Python<'_>,
        function: u64,
        threads: u32,
        shared: u32,
        params: Vec<String>,
        rows: u32,
        ctas: u32,
        row_bytes: u32,
        chained: bool,
    ) -> PyResult<Option<u32>> {
        let params = params
            .iter()
            .map(|p| p.parse::<KernelParam>().map_err(invalid))
            .collect::<PyResult<Vec<_>>>()?;
        let spec = KernelSpec {
            function,
            threads,
            shared,
            params,
            rows,
            ctas,
            row_bytes,
            chained,
        };
        py.detach(|| self.engine.load_kernel(spec))
            .map_err(Into::into)
    }

    /// The bytes of a block's row where the table is block-major (the staged plan moves a row
    /// per block), else None.
    fn staged_row(&self, py: Python<'_>, table: u32) -> PyResult<Option<u64>> {
        // The engine lock: taken with the GIL released (see `register_table`).
        Ok(py.detach(|| self.engine.staged_row(table))?)
    }

    /// Bytes of each staging slot (the `stage_bytes` option): the largest row a staged plan takes.
    #[getter]
    fn stage_bytes(&self) -> u64 {
        self.engine.stage_bytes()
    }

    /// The block plan of a table pair: `(first segment, rows, width, src pitch, dst pitch)` per
    /// 2-D copy of one block, or None where the pair has none.
    #[pyo3(signature = (src_table, dst_table, direction = "h2d"))]
    #[allow(clippy::type_complexity)]
    fn block_runs(
        &self,
        py: Python<'_>,
        src_table: u32,
        dst_table: u32,
        direction: &str,
    ) -> PyResult<Option<Vec<(usize, u64, u64, u64, u64)>>> {
        let dir = self::direction(direction)?;
        let runs = py.detach(|| self.engine.block_runs(src_table, dst_table, dir))?;
        Ok(runs.map(|rs| {
            rs.iter()
                .map(|r| (r.first, r.rows, r.width, r.src_pitch, r.dst_pitch))
                .collect()
        }))
    }

    /// Whether a cache whose KV-cache groups are the table pairs `pairs` (source, destination as
    /// `direction` moves them) takes the block route: by default where each group's plan is at
    /// most `BLOCK_MAX_COPIES` 2-D copies of pages of at least `BLOCK_MIN_PAGE` bytes, with
    /// `insist` wherever it saves a copy; never where two groups share memory. Returns `(taken,
    /// why)`.
    #[pyo3(signature = (pairs, direction, insist = false))]
    fn block_route(
        &self,
        py: Python<'_>,
        pairs: Vec<(u32, u32)>,
        direction: &str,
        insist: bool,
    ) -> PyResult<(bool, String)> {
        let dir = self::direction(direction)?;
        let route = py.detach(|| self.engine.block_route(&pairs, dir, insist))?;
        Ok(match route {
            Ok(why) => (true, why),
            Err(why) => (false, why),
        })
    }

    /// Whether a cache whose KV-cache groups have the host tables `host_tables` takes the
    /// staged plan with this engine's slots (every table block-major, its rows no larger than
    /// `stage_bytes`): `(the largest row, "")`, or `(None, why not)`.
    fn staged_route(
        &self,
        py: Python<'_>,
        host_tables: Vec<u32>,
    ) -> PyResult<(Option<u64>, String)> {
        let route = py.detach(|| self.engine.staged_route(&host_tables))?;
        Ok(match route {
            Ok(row) => (Some(row), String::new()),
            Err(why) => (None, why),
        })
    }

    /// Results of the transfers finished since the last call. Lock-free, never blocks.
    fn get_finished(&self) -> Vec<PyTransferResult> {
        let mut out = Vec::new();
        self.engine.get_finished(&mut out);
        out.into_iter().map(Into::into).collect()
    }

    /// Blocks (GIL released, no spinning) until the listed jobs finished.
    #[pyo3(signature = (job_ids, timeout = None))]
    fn wait(&self, py: Python<'_>, job_ids: Vec<u64>, timeout: Option<f64>) -> PyResult<()> {
        let timeout = timeout
            .map(|t| engine::seconds("timeout", t))
            .transpose()
            .map_err(EngineError::from)?;
        py.detach(|| self.engine.wait(&job_ids, timeout))
            .map_err(Into::into)
    }

    /// Waits for transfers in flight and stops the backend; results stay available. Idempotent.
    fn shutdown(&self, py: Python<'_>) {
        py.detach(|| self.engine.shutdown());
    }

    #[getter]
    fn is_shut_down(&self) -> bool {
        self.engine.is_shut_down()
    }

    /// Registers `nbytes` at `ptr` as `kind` memory ('host' or 'device') that transfers may use.
    /// The caller vouches that the memory stays allocated until unregistered.
    fn register(&self, py: Python<'_>, ptr: u64, nbytes: u64, kind: &str) -> PyResult<()> {
        let kind = MemoryKind::parse(kind)
            .ok_or_else(|| invalid(format!("kind must be 'host' or 'device', not {kind:?}")))?;
        // SAFETY: the Python caller vouches for the range (documented on Engine.register); the
        // Python layer registers only memory of objects it keeps alive.
        py.detach(|| unsafe { self.engine.register(ptr, nbytes, kind) })
            .map_err(Into::into)
    }

    /// Page-locks `nbytes` of existing host memory at `ptr` (cuMemHostRegister on CUDA) and
    /// registers it as host memory. `unregister(ptr)` unpins it.
    fn pin(&self, py: Python<'_>, ptr: u64, nbytes: u64) -> PyResult<()> {
        // SAFETY: as for `register`: the Python caller vouches for the range.
        py.detach(|| unsafe { self.engine.pin(ptr, nbytes) })
            .map_err(Into::into)
    }

    fn unregister(&self, py: Python<'_>, ptr: u64) -> PyResult<()> {
        py.detach(|| self.engine.unregister(ptr))
            .map_err(Into::into)
    }

    /// Allocates `nbytes` of host memory (page-locked on CUDA), registered; returns its address.
    fn alloc_host(&self, py: Python<'_>, nbytes: usize) -> PyResult<u64> {
        if nbytes == 0 {
            return Err(invalid("nbytes must be positive"));
        }
        py.detach(|| self.engine.alloc_host(nbytes))
            .map_err(Into::into)
    }

    fn free_host(&self, py: Python<'_>, ptr: u64) -> PyResult<()> {
        py.detach(|| self.engine.free_host(ptr)).map_err(Into::into)
    }

    /// Test hook: the next `count` transfers fail in the middle of their copies (host: the
    /// worker stops there; CUDA: the driver is handed a null address there and refuses it).
    fn inject_failures(&self, count: u64) {
        self.engine.inject_failures(count);
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.engine.stats();
        let latency = self.engine.latency();
        let d = PyDict::new(py);
        for dir in Direction::ALL {
            let l = s.lanes[dir.lane()];
            let ld = PyDict::new(py);
            let t = latency[dir.lane()];
            let secs = |ns: Option<u64>| ns.map(|n| n as f64 * 1e-9);
            ld.set_item("wall_p50", secs(t.transfer_p50_ns))?;
            ld.set_item("wall_p99", secs(t.transfer_p99_ns))?;
            ld.set_item("submit_p50", secs(t.submit_p50_ns))?;
            ld.set_item("submit_p99", secs(t.submit_p99_ns))?;
            ld.set_item("refused", t.refused)?;
            ld.set_item("submit_failed", t.submit_failed)?;
            ld.set_item("transfers", l.transfers)?;
            ld.set_item("failed", l.failed)?;
            ld.set_item("bytes", l.bytes)?;
            ld.set_item("seconds", l.seconds)?;
            ld.set_item(
                "gb_per_s",
                if l.seconds > 0.0 {
                    l.bytes as f64 / l.seconds / 1e9
                } else {
                    0.0
                },
            )?;
            d.set_item(dir.as_str(), ld)?;
        }
        d.set_item("in_flight", s.in_flight)?;
        d.set_item("driver_ns", s.driver_ns)?;
        d.set_item("submit_ns", s.submit_ns)?;
        d.set_item("prepare_ns", s.prepare_ns)?;
        d.set_item("shutdown_timed_out", s.shutdown_timed_out)?;
        let p = PyDict::new(py);
        p.set_item("slabs", s.pool.slabs)?;
        p.set_item("free", s.pool.free)?;
        p.set_item("bytes", s.pool.bytes)?;
        p.set_item("cap", s.pool.cap)?;
        d.set_item("pool", p)?;
        Ok(d)
    }

    /// Backend, driver and copy path in use.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let i = self.engine.backend_info();
        let c = self.engine.config();
        let d = PyDict::new(py);
        d.set_item("backend", i.name)?;
        d.set_item("driver_version", i.driver_version)?;
        d.set_item("device", i.device)?;
        d.set_item("copy_path", i.copy_path)?;
        d.set_item("completion", i.completion)?;
        d.set_item("max_in_flight", c.max_in_flight)?;
        d.set_item("pool_bytes", c.pool_bytes)?;
        d.set_item("max_descriptors", c.max_descriptors)?;
        d.set_item("coalesce", c.coalesce)?;
        Ok(d)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _ty: Option<Bound<'_, PyAny>>,
        _value: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) {
        self.shutdown(py);
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<PyEngine>()?;
    m.add_class::<PyTransferResult>()?;
    m.add_class::<PyRoute>()?;
    m.add("BLOCK_MAX_COPIES", table::BLOCK_MAX_COPIES)?;
    m.add("BLOCK_MIN_PAGE", table::BLOCK_MIN_PAGE)?;
    m.add_class::<PyHostBuffer>()?;
    m.add_class::<host_buffer::PyAllocProgress>()?;
    m.add("DEFAULT_PIECE_BYTES", hostmem::DEFAULT_PIECE_BYTES)?;
    m.add("REGISTRATION_LIMIT", hostmem::REGISTRATION_LIMIT)?;
    m.add("MAX_IN_FLIGHT", crate::backend::MAX_IN_FLIGHT)?;
    m.add_function(wrap_pyfunction!(functions::host_memory_available, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_status, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_memory_kind, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_device_pointer, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_memcpy, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_pin, m)?)?;
    m.add_function(wrap_pyfunction!(host_buffer::fill_and_pin, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_unpin, m)?)?;
    m.add_function(wrap_pyfunction!(chunk_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(chunk_skip, m)?)?;
    m.add_function(wrap_pyfunction!(chunk_count, m)?)?;
    m.add_function(wrap_pyfunction!(launch_plan, m)?)?;
    m.add_function(wrap_pyfunction!(table_incompatibility, m)?)?;
    m.add_function(wrap_pyfunction!(route_candidates, m)?)?;
    m.add("KERNEL_BELOW_H2D", choice::KERNEL_BELOW_H2D)?;
    m.add("KERNEL_BELOW_D2H", choice::KERNEL_BELOW_D2H)?;
    m.add("STAGED_CTAS", choice::STAGED_CTAS)?;
    m.add("STAGE_BYTES", choice::STAGE_BYTES)?;
    m.add("STAGE_MAX_AUTO", choice::STAGE_MAX_AUTO)?;
    m.add("HOST_ROUTE", choice::HOST_ROUTE)?;
    m.add_function(wrap_pyfunction!(stage_slot, m)?)?;
    m.add("BlockswapError", py.get_type::<BlockswapError>())?;
    m.add(
        "InvalidTransferError",
        py.get_type::<InvalidTransferError>(),
    )?;
    m.add("PoolExhaustedError", py.get_type::<PoolExhaustedError>())?;
    m.add("BackendError", py.get_type::<BackendError>())?;
    m.add("ShutdownError", py.get_type::<ShutdownError>())?;
    m.add("WaitTimeoutError", py.get_type::<WaitTimeoutError>())?;
    Ok(())
}
