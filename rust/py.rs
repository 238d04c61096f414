//! `PyO3` bindings: argument conversion, GIL release, error mapping. No decisions live here.
//! The engine here; host buffers and the module's functions in `py/`.

mod args;
mod detached;
mod engine;
mod functions;
mod host_buffer;
mod route;
mod stats;
mod submit;

use engine::PyEngine;
use functions::{
    chunk_blocks, chunk_count, chunk_skip, cuda_device_pointer, cuda_memcpy, cuda_memory_kind,
    cuda_pin, cuda_status, cuda_unpin, launch_plan, stage_slot, table_incompatibility,
};
use host_buffer::PyHostBuffer;
use route::{choose_route, PyRoute};

use std::cell::Cell;

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyKeyboardInterrupt};
use pyo3::prelude::*;

use crate::backend::cuda;
use crate::direction::Direction;
use crate::engine::EngineError;
use crate::hostmem::{self, HostBuffer, HostBufferError, Pinner};
use crate::kernel::KernelBatch;
use crate::plan::choice;
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

fn direction(s: &str) -> PyResult<Direction> {
    Direction::parse(s).ok_or_else(|| {
        invalid(format!(
            "direction must be 'h2d', 'd2h', 'h2h' or 'd2d', not {s:?}"
        ))
    })
}

thread_local! {
    /// How many Python kernel launchers this thread is running (nested only where a launcher's
    /// engine call were let through). A launcher runs inside a submission, under its engine's
    /// submit lock: a call from it that takes a submit lock or waits, into any engine, could wait
    /// forever, for its own engine's lock or for the transfer it is launching, or for another
    /// engine whose launcher, on another thread, waits for this one's lock (engine A's launcher
    /// submits to B while B's submits to A). Every such call is refused there.
    static LAUNCHING: Cell<usize> = const { Cell::new(0) };
}

/// Calls a Python kernel launcher (re-taking the GIL) for the kernel part of a transfer. A
/// launcher's error fails the transfer; a `KeyboardInterrupt` is raised again once control is
/// back in Python, not lost in the transfer's error.
fn call_launcher(launcher: &Py<PyAny>, b: KernelBatch) -> Result<(), String> {
    LAUNCHING.with(|l| l.set(l.get() + 1));
    let result = Python::attach(|py| {
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
            .map_err(|e| {
                let reason = e.to_string();
                // Marked pending after the last call into Python here, which would raise it.
                if e.is_instance_of::<PyKeyboardInterrupt>(py) {
                    // SAFETY: the interpreter is initialised (this thread holds the GIL), and
                    // the call only marks SIGINT as pending for the main thread to raise.
                    unsafe { pyo3::ffi::PyErr_SetInterrupt() };
                }
                reason
            })
    });
    LAUNCHING.with(|l| l.set(l.get() - 1));
    result
}

/// Whether this thread runs a kernel launcher, of any engine (see [`LAUNCHING`]).
fn launching() -> bool {
    LAUNCHING.with(|l| l.get() > 0)
}

/// Whether this thread runs a kernel launcher (of any engine), where every engine call that takes
/// a submit lock or waits is refused: the Python layer takes no lock of its own around such a
/// call (it could wait for a thread that waits for this launcher's submission).
#[pyfunction]
fn in_launcher() -> bool {
    launching()
}

/// Holds the process-wide table of host buffers' lock for `seconds`, the GIL released, as a
/// registration walking many pieces holds it: for tests of what another thread (a fork) does
/// meanwhile.
#[pyfunction]
fn hold_host_buffer_table(py: Python<'_>, seconds: f64) {
    let d = std::time::Duration::from_secs_f64(seconds.clamp(0.0, 60.0));
    py.detach(|| crate::hostmem::hold_table(d));
}

/// Refuses `what` (a call into an engine that takes its submit lock or waits) from inside a
/// kernel launcher, of this engine or any other (see [`LAUNCHING`]), which could deadlock the
/// process.
fn not_launching(what: &str) -> PyResult<()> {
    if launching() {
        return Err(invalid(format!(
            "{what} called from inside a kernel launcher (this engine's or another's), which \
             runs while its engine holds its submit lock: a launcher may only launch its kernel, \
             never call into an engine that locks or waits"
        )));
    }
    Ok(())
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
    m.add(
        "MAX_KEEP_WARM",
        crate::backend::cuda::MAX_KEEP_WARM.as_secs_f64(),
    )?;
    m.add_function(wrap_pyfunction!(functions::host_memory_available, m)?)?;
    m.add_function(wrap_pyfunction!(in_launcher, m)?)?;
    m.add_function(wrap_pyfunction!(hold_host_buffer_table, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_status, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_memory_kind, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_device_pointer, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_memcpy, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_pin, m)?)?;
    m.add_function(wrap_pyfunction!(host_buffer::fill_and_pin, m)?)?;
    m.add_function(wrap_pyfunction!(host_buffer::shmem_huge, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_unpin, m)?)?;
    m.add_function(wrap_pyfunction!(chunk_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(chunk_skip, m)?)?;
    m.add_function(wrap_pyfunction!(chunk_count, m)?)?;
    m.add_function(wrap_pyfunction!(launch_plan, m)?)?;
    m.add_function(wrap_pyfunction!(table_incompatibility, m)?)?;
    m.add_function(wrap_pyfunction!(functions::table_spans, m)?)?;
    m.add_function(wrap_pyfunction!(functions::tensor_segments, m)?)?;
    m.add_function(wrap_pyfunction!(functions::mirror_geometry, m)?)?;
    m.add_function(wrap_pyfunction!(functions::block_major_views, m)?)?;
    m.add_function(wrap_pyfunction!(choose_route, m)?)?;
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
    m.add("ArgumentTypeError", args::argument_type_error(py)?)?;
    m.add_function(wrap_pyfunction!(args::check_int_py, m)?)?;
    m.add_function(wrap_pyfunction!(args::shown_py, m)?)?;
    Ok(())
}
