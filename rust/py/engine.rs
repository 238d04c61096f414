//! `Engine`: the core's engine as Python's `blockswap.Engine` (a Python subclass adds what
//! needs Python objects: registering an array or tensor and keeping it alive, the log lines).
//! Every argument is checked and converted here ([`super::args`]), with the GIL released while
//! the engine works.

// The docs here are the Python class's docstrings (reStructuredText, as `help()` shows them),
// not rustdoc's markdown.
#![allow(clippy::doc_markdown)]

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::args::{
    self, direction_arg, kind_arg, launcher_arg, Given, IntArg, BACKENDS, COMPLETIONS, COPY_PATHS,
    I128, I32, ORDERS, STREAM, U64, U64_MAX,
};
use super::detached::DropDetached;
use super::submit::{self, submission};
use super::{call_launcher, invalid, not_launching, PyTransferResult};
use crate::backend::cuda::{CudaBackend, CudaOptions};
use crate::backend::host::HostBackend;
use crate::backend::Backend;
use crate::descriptor::{Batch, DescriptorError};
use crate::direction::Direction;
use crate::engine::{self, Chunks, Engine, EngineConfig, EngineError, GroupIds};
use crate::kernel::{KernelBatch, KernelLauncher, KernelParam, KernelSpec, PageKernel};
use crate::table;

/// Moves batches of ``(src, dst, size)`` blocks on a backend.
///
/// ``backend`` is ``"auto"`` (CUDA where a driver is present, else host), ``"cuda"`` or
/// ``"host"`` (``memcpy`` on a worker thread: runs anywhere, and stands in for the GPU in tests).
///
/// Options of every backend:
///
/// - ``max_in_flight``: transfers in flight per direction before :meth:`submit` refuses
///   (1 to 16,384);
/// - ``pool_bytes``: byte cap of the descriptor slab pool (at least 6,144: one slab);
/// - ``max_descriptors``: descriptors one transfer may carry (1 to 2**20, the default);
/// - ``coalesce``: merge descriptors whose source and destination both continue the previous one,
///   and join the staged plan's rows of blocks adjacent on the host, their ids counting up or down;
/// - ``shutdown_timeout``: seconds :meth:`shutdown` waits for transfers in flight before failing
///   them (``math.inf``: as long as they take);
/// - ``stage_bytes``: bytes of each of a direction's two staging slots (the staged plan);
/// - ``stage_step_bytes``: the fewest bytes a full step of the staged plan carries behind a
///   running transfer of its direction, where the transfer has them (8 MiB by default): a
///   smaller one takes fewer steps, as each step's batch of rows costs the copy engine a start;
///   ``1``: four full steps whatever the size, as an isolated transfer takes.
///
/// Options of the CUDA backend (the host backend ignores them, with a warning where one is not
/// the default): ``device``; ``copy_path`` (``"auto"``, ``"batch"``, ``"loop"``); ``max_batch``
/// (descriptors per driver call, 64 by default: another thread's driver calls, the model's
/// launches among them, wait while one is in progress); ``timing`` (device time from events);
/// ``completion`` (``"auto"``, ``"write_value"``, ``"event"``); ``h2d_order`` / ``d2h_order``
/// (source access order, ``"any"`` or ``"stream"``); ``h2d_stream`` / ``d2h_stream`` (a raw
/// ``CUstream`` to use instead of the engine's own); ``idle_issue`` (where the engine's thread
/// for a direction holds no transfer, :meth:`submit` issues a staged transfer's first step on
/// the caller's thread and wakes that thread for the rest, and, where every earlier transfer of
/// the direction is complete, any other transfer whole: an isolated transfer starts sooner, and
/// the caller pays those driver calls; see docs/tuning.md); ``early_wake`` (on by default: a
/// direction's sleeping thread is woken when a handler starts building a transfer, not when the
/// transfer is queued, and polls for it a while; see docs/tuning.md); ``keep_warm`` (seconds,
/// 0.1 by default, 0 to 3600: how long a direction's thread stays ready after it issued a
/// transfer, waking every 100 µs for one cheap driver call, instead of sleeping until the next
/// one; a transfer within that time starts sooner; see docs/tuning.md).
///
/// ``cpus`` (both backends): CPU ids the engine's threads run on (a list, a set); by default
/// they inherit the affinity of the thread that makes the engine, with a warning where that is
/// one CPU, which they would share with it (see docs/tuning.md).
///
/// Every address a transfer names must lie in memory registered with :meth:`register`,
/// :meth:`pin` or :meth:`alloc_host`; anything else is refused before a copy is issued.
///
/// Every refusal is a :class:`~blockswap.BlockswapError`; an argument of the wrong type is an
/// :class:`~blockswap.ArgumentTypeError` naming it (an ``InvalidTransferError`` and a
/// ``TypeError``; an unknown keyword option is Python's own ``TypeError``). An engine that is
/// garbage-collected first waits for its transfers in flight, so registered objects are never
/// freed under a copy.
#[pyclass(name = "Engine", module = "blockswap._core", frozen, subclass)]
pub(super) struct PyEngine {
    // Boxed: the engine's lock-free queues are cache-line aligned (128 bytes), more than the
    // 16 bytes Python's allocator gives the object PyO3 writes this struct into. Held inline,
    // every access would be a misaligned reference (debug builds abort on the first one). Dropped
    // with the GIL released (the drop drains the engine, takes the host-buffer table's lock).
    pub(super) engine: DropDetached<Box<Engine>>,
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(
        signature = (backend = Given(None), *, device = Given(None), max_in_flight = Given(None),
            pool_bytes = Given(None), max_descriptors = Given(None), coalesce = Given(None),
            shutdown_timeout = Given(None), copy_path = Given(None), max_batch = Given(None),
            timing = Given(None), completion = Given(None), h2d_order = Given(None),
            d2h_order = Given(None), h2d_stream = Given(None), d2h_stream = Given(None),
            stage_bytes = Given(None), stage_step_bytes = Given(None), idle_issue = Given(None),
            early_wake = Given(None), keep_warm = Given(None), cpus = Given(None)),
        text_signature = "(backend='auto', *, device=0, max_in_flight=1024, \
            pool_bytes=268435456, max_descriptors=None, coalesce=True, shutdown_timeout=60.0, \
            copy_path='auto', max_batch=None, timing=False, completion='auto', h2d_order='any', \
            d2h_order='stream', h2d_stream=None, d2h_stream=None, stage_bytes=16777216, \
            stage_step_bytes=8388608, idle_issue=False, early_wake=True, keep_warm=0.1, \
            cpus=None)"
    )]
    // The Python signature's keyword arguments, one parameter each.
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        backend: Given<'_>,
        device: Given<'_>,
        max_in_flight: Given<'_>,
        pool_bytes: Given<'_>,
        max_descriptors: Given<'_>,
        coalesce: Given<'_>,
        shutdown_timeout: Given<'_>,
        copy_path: Given<'_>,
        max_batch: Given<'_>,
        timing: Given<'_>,
        completion: Given<'_>,
        h2d_order: Given<'_>,
        d2h_order: Given<'_>,
        h2d_stream: Given<'_>,
        d2h_stream: Given<'_>,
        stage_bytes: Given<'_>,
        stage_step_bytes: Given<'_>,
        idle_issue: Given<'_>,
        early_wake: Given<'_>,
        keep_warm: Given<'_>,
        cpus: Given<'_>,
    ) -> PyResult<Self> {
        let text = |g: &Given<'_>, name: &str, choices: &str, default: &str| {
            g.or(default.to_owned(), |v| args::text(name, v, choices))
        };
        let flag =
            |g: &Given<'_>, name: &str, default: bool| g.or(default, |v| args::flag(name, v));
        let backend = text(&backend, "backend", BACKENDS, "auto")?;
        let device_n: i32 = device.or(0, |v| args::int("device", v, I32))?;
        let max_in_flight: i128 =
            max_in_flight.or(1024, |v| args::int("max_in_flight", v, I128))?;
        let pool_bytes: i128 = pool_bytes.or(256 << 20, |v| args::int("pool_bytes", v, I128))?;
        let max_descriptors: Option<i128> =
            max_descriptors.or(None, |v| args::opt_int("max_descriptors", Some(v), I128))?;
        let coalesce = flag(&coalesce, "coalesce", true)?;
        let shutdown_timeout =
            shutdown_timeout.or(60.0, |v| args::seconds("shutdown_timeout", v))?;
        let copy_path_s = text(&copy_path, "copy_path", COPY_PATHS, "auto")?;
        let max_batch_n: Option<usize> = max_batch
            .or(None, |v| args::opt_int("max_batch", Some(v), U64))?
            .filter(|&m| m != crate::backend::cuda::DEFAULT_MAX_BATCH);
        let timing_b = flag(&timing, "timing", false)?;
        let completion_s = text(&completion, "completion", COMPLETIONS, "auto")?;
        let h2d_order_s = text(&h2d_order, "h2d_order", ORDERS, "any")?;
        let d2h_order_s = text(&d2h_order, "d2h_order", ORDERS, "stream")?;
        let stream = |g: &Given<'_>, name: &str| -> PyResult<Option<u64>> {
            g.or(None, |v| args::opt_int(name, Some(v), U64.named(STREAM)))
        };
        let h2d_stream_n = stream(&h2d_stream, "h2d_stream")?;
        let d2h_stream_n = stream(&d2h_stream, "d2h_stream")?;
        let stage_bytes: i128 = stage_bytes.or(16 << 20, |v| args::int("stage_bytes", v, I128))?;
        let stage_step_bytes: i128 = stage_step_bytes
            .or(i128::from(crate::table::STAGED_STEP_BYTES), |v| {
                args::int("stage_step_bytes", v, I128)
            })?;
        let idle_issue_b = flag(&idle_issue, "idle_issue", false)?;
        let early_wake_b = flag(&early_wake, "early_wake", true)?;
        let default_warm = crate::backend::cuda::DEFAULT_KEEP_WARM.as_secs_f64();
        let max_warm = crate::backend::cuda::MAX_KEEP_WARM.as_secs_f64();
        let keep_warm_s = keep_warm.or(default_warm, |v| args::seconds("keep_warm", v))?;
        if !(0.0..=max_warm).contains(&keep_warm_s) {
            return Err(invalid(format!(
                "keep_warm must be a number of seconds from 0 to {max_warm}, not {keep_warm_s}"
            )));
        }

        let cpus = args::cpus_option(py, &cpus)?;
        let config = EngineConfig::from_settings(
            max_in_flight,
            pool_bytes,
            max_descriptors,
            coalesce,
            shutdown_timeout,
        )
        .and_then(|c| c.stage_bytes(stage_bytes))
        .and_then(|c| c.stage_step_bytes(stage_step_bytes))
        .map_err(EngineError::from)?;
        let want_cuda = crate::backend::is_cuda(&backend).map_err(invalid)?;
        // Parsed on every backend, so that a misspelt option is refused on machines without a
        // GPU too.
        let mut opts = CudaOptions::new(device_n);
        opts.copy_path = copy_path_s.parse().map_err(invalid)?;
        if let Some(m) = max_batch_n {
            if m == 0 {
                return Err(invalid(
                    "max_batch must be at least 1 (copies in one driver call), not 0",
                ));
            }
            opts.max_batch = m;
        }
        opts.timing = timing_b;
        opts.completion = completion_s.parse().map_err(invalid)?;
        // The parse error names the kind of setting; the argument is named here.
        let order = |name: &str, value: &str| {
            value
                .parse()
                .map_err(|e| invalid(format!("{name} (source access order) {e}")))
        };
        opts.access_order[Direction::HostToDevice.lane()] = order("h2d_order", &h2d_order_s)?;
        opts.access_order[Direction::DeviceToHost.lane()] = order("d2h_order", &d2h_order_s)?;
        opts.streams[Direction::HostToDevice.lane()] = h2d_stream_n;
        opts.streams[Direction::DeviceToHost.lane()] = d2h_stream_n;
        opts.max_in_flight = config.max_in_flight;
        opts.idle_issue = idle_issue_b;
        opts.early_wake = early_wake_b;
        opts.keep_warm = std::time::Duration::from_secs_f64(keep_warm_s);
        opts.cpus.clone_from(&cpus);
        let backend: Arc<dyn Backend> = if want_cuda {
            let b = py
                .detach(|| CudaBackend::new(opts))
                .map_err(EngineError::from)?;
            Arc::new(b)
        } else {
            // The CUDA options this backend ignores, where one differs from its default.
            args::warn_host_ignores(
                py,
                [
                    device.changed("device", device_n != 0),
                    copy_path.changed("copy_path", copy_path_s != "auto"),
                    max_batch.changed("max_batch", max_batch_n.is_some()),
                    timing.changed("timing", timing_b),
                    completion.changed("completion", completion_s != "auto"),
                    h2d_order.changed("h2d_order", h2d_order_s != "any"),
                    d2h_order.changed("d2h_order", d2h_order_s != "stream"),
                    h2d_stream.changed("h2d_stream", h2d_stream_n.is_some()),
                    d2h_stream.changed("d2h_stream", d2h_stream_n.is_some()),
                    idle_issue.changed("idle_issue", idle_issue_b),
                    early_wake.changed("early_wake", !early_wake_b),
                    keep_warm.changed("keep_warm", (keep_warm_s - default_warm).abs() > 1e-9),
                ],
            )?;
            Arc::new(HostBackend::with_cpus(cpus))
        };
        let engine = PyEngine {
            engine: DropDetached::new(Box::new(Engine::try_new(backend, config)?)),
        };
        // What the core chose, logged by the Python layer (the package's logger).
        let info = engine.info(py)?;
        py.import("blockswap.engine")?
            .getattr("_log_start")?
            .call1((info, copy_path_s))?;
        Ok(engine)
    }

    /// Issues one transfer and returns at once; its result comes from :meth:`get_finished`.
    ///
    /// ``src_ptrs``, ``dst_ptrs`` and ``sizes``: one entry per descriptor (1-D integer arrays,
    /// lists of ints). ``direction`` is ``"h2d"``, ``"d2h"``, ``"h2h"`` or ``"d2d"``.
    /// ``wait_stream`` (a raw ``CUstream`` such as ``torch.cuda.current_stream().cuda_stream``)
    /// makes the copies wait for the work issued on that stream so far.
    ///
    /// With ``launcher`` (e.g. :func:`blockswap.kernels.engine_launcher`), descriptors smaller
    /// than ``kernel_below`` bytes (after coalescing) are moved by the copy kernel it launches
    /// on the engine's stream as ``launcher(src_col, dst_col, size_col, n, max_size, alignment,
    /// stream)``, reading the descriptors from the pinned slab in place; the rest go to DMA, in
    /// the same transfer.
    #[pyo3(signature = (job_id, src_ptrs, dst_ptrs, sizes, direction = Given(None), *, wait_stream = None,
        kernel_below = Given(None), launcher = None),
        text_signature = "(self, job_id, src_ptrs, dst_ptrs, sizes, direction='h2d', *, \
            wait_stream=None, kernel_below=0, launcher=None)")]
    // The Python signature's keyword arguments, one parameter each.
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        py: Python<'_>,
        job_id: &Bound<'_, PyAny>,
        src_ptrs: &Bound<'_, PyAny>,
        dst_ptrs: &Bound<'_, PyAny>,
        sizes: &Bound<'_, PyAny>,
        direction: Given<'_>,
        wait_stream: Option<&Bound<'_, PyAny>>,
        kernel_below: Given<'_>,
        launcher: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        not_launching("submit")?;
        let job_id = args::job_id(job_id)?;
        let launcher = launcher_arg(launcher)?;
        let (s, d, z) = (
            args::ids("src_ptrs", src_ptrs)?,
            args::ids("dst_ptrs", dst_ptrs)?,
            args::ids("sizes", sizes)?,
        );
        let (dir, wait_stream, kernel_below) = submission(&direction, wait_stream, &kernel_below)?;
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

    /// Registers a block table: one side of a KV cache, where segment ``s`` of block ``b`` is
    /// ``nbytes[s]`` bytes at ``bases[s] + b * strides[s]``. The core checks every segment's
    /// span, over all ``num_blocks`` blocks, against registered ``kind`` memory (``"host"`` or
    /// ``"device"``) once, here: one region, or adjacent ones (memory registered in pieces, see
    /// :mod:`blockswap.hostmem`) where no page crosses from one into the next. ``name`` names the
    /// table's blocks in errors. ``unit`` (at most ``num_blocks``): table blocks per block the
    /// caller names (a CPU block of ``unit`` GPU-sized sub-blocks), used where
    /// :meth:`submit_groups` names this side by chunk ids, and in errors. Returns the table's id for :meth:`submit_blocks` and
    /// :meth:`submit_groups`.
    #[pyo3(signature = (bases, strides, nbytes, num_blocks, kind, name = Given(None), unit = Given(None)),
        text_signature = "(self, bases, strides, nbytes, num_blocks, kind, name='', unit=1)")]
    // The Python signature's keyword arguments, one parameter each.
    #[allow(clippy::too_many_arguments)]
    fn register_table(
        &self,
        py: Python<'_>,
        bases: &Bound<'_, PyAny>,
        strides: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
        num_blocks: &Bound<'_, PyAny>,
        kind: &Bound<'_, PyAny>,
        name: Given<'_>,
        unit: Given<'_>,
    ) -> PyResult<u32> {
        not_launching("register_table")?;
        let mut cols = Vec::with_capacity(3);
        for (col, values) in [("bases", bases), ("strides", strides), ("nbytes", nbytes)] {
            let v = args::ids(col, values)?;
            // Copied from int64: a negative value is one past 2**63 here.
            if let Some(&neg) = v.iter().filter(|&&x| x > i64::MAX as u64).min() {
                return Err(invalid(format!(
                    "{col} holds a negative value ({})",
                    neg as i64
                )));
            }
            cols.push(v);
        }
        let num_blocks: u64 = args::int("num_blocks", num_blocks, IntArg::within(1, U64_MAX))?;
        let kind = kind_arg(kind)?;
        let name = name.or(String::new(), |n| args::text("name", n, "a str"))?;
        let unit: u64 = unit.or(1, |u| args::int("unit", u, IntArg::within(1, U64_MAX)))?;
        let (n, st, b) = (
            cols.pop().expect("3"),
            cols.pop().expect("3"),
            cols.pop().expect("3"),
        );
        // Every binding that takes the engine lock lets go of the GIL first: a submit holding the
        // lock may be waiting for the GIL (a Python launcher), and would wait forever.
        py.detach(|| {
            self.engine.register_table(
                table::TableSpec::new(b, st, n, num_blocks, kind).named(&name, unit),
            )
        })
        .map_err(Into::into)
    }

    /// Removes a block table (refused while transfers are in flight).
    fn unregister_table(&self, py: Python<'_>, table: &Bound<'_, PyAny>) -> PyResult<()> {
        not_launching("unregister_table")?;
        let table = args::table_id(table)?;
        Ok(py.detach(|| self.engine.unregister_table(table))?)
    }

    /// Issues the transfer of blocks ``src_ids`` of table ``src_table`` to blocks ``dst_ids`` of
    /// ``dst_table`` (see :meth:`register_table`): the core checks each id against its table
    /// (negative ids included) and that destination ids are distinct, then writes the
    /// descriptors itself. Otherwise as :meth:`submit`.
    #[pyo3(signature = (job_id, src_table, src_ids, dst_table, dst_ids, direction = Given(None), *,
        wait_stream = None, kernel_below = Given(None), launcher = None),
        text_signature = "(self, job_id, src_table, src_ids, dst_table, dst_ids, direction='h2d', \
            *, wait_stream=None, kernel_below=0, launcher=None)")]
    // The Python signature's keyword arguments, one parameter each.
    #[allow(clippy::too_many_arguments)]
    fn submit_blocks(
        &self,
        py: Python<'_>,
        job_id: &Bound<'_, PyAny>,
        src_table: &Bound<'_, PyAny>,
        src_ids: &Bound<'_, PyAny>,
        dst_table: &Bound<'_, PyAny>,
        dst_ids: &Bound<'_, PyAny>,
        direction: Given<'_>,
        wait_stream: Option<&Bound<'_, PyAny>>,
        kernel_below: Given<'_>,
        launcher: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        not_launching("submit_blocks")?;
        let job_id = args::job_id(job_id)?;
        let launcher = launcher_arg(launcher)?;
        let (src_table, dst_table) = (args::table_id(src_table)?, args::table_id(dst_table)?);
        let (s, d) = (
            args::ids("src_ids", src_ids)?,
            args::ids("dst_ids", dst_ids)?,
        );
        let (dir, wait_stream, kernel_below) = submission(&direction, wait_stream, &kernel_below)?;
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

    /// :meth:`submit_blocks`, each block moved by the pair's block plan (see
    /// :meth:`block_runs`): one 2-D copy per run of its pages instead of a descriptor per page,
    /// on the copy engines only. Refused where the pair has no block plan.
    #[pyo3(signature = (job_id, src_table, src_ids, dst_table, dst_ids, direction = Given(None), *,
        wait_stream = None),
        text_signature = "(self, job_id, src_table, src_ids, dst_table, dst_ids, direction='h2d', \
            *, wait_stream=None)")]
    // The Python signature's keyword arguments, one parameter each.
    #[allow(clippy::too_many_arguments)]
    fn submit_block_runs(
        &self,
        py: Python<'_>,
        job_id: &Bound<'_, PyAny>,
        src_table: &Bound<'_, PyAny>,
        src_ids: &Bound<'_, PyAny>,
        dst_table: &Bound<'_, PyAny>,
        dst_ids: &Bound<'_, PyAny>,
        direction: Given<'_>,
        wait_stream: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        not_launching("submit_block_runs")?;
        let job_id = args::job_id(job_id)?;
        let (src_table, dst_table) = (args::table_id(src_table)?, args::table_id(dst_table)?);
        let (s, d) = (
            args::ids("src_ids", src_ids)?,
            args::ids("dst_ids", dst_ids)?,
        );
        let (dir, wait_stream, _) = submission(&direction, wait_stream, &Given(None))?;
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

    /// Announces a transfer about to be submitted on ``direction``: with ``early_wake`` (the
    /// default) the engine's sleeping thread for that direction wakes now, while the caller
    /// builds the transfer, rather than when it is queued. Every submission announces itself;
    /// call this first where building the descriptors takes a while. Does nothing on the host
    /// backend or after :meth:`shutdown`; never waits for copies.
    fn wake(&self, py: Python<'_>, direction: &Bound<'_, PyAny>) -> PyResult<()> {
        let dir = direction_arg(direction)?;
        // Detached: the wake takes the lane's queue lock, which the lane's thread holds briefly.
        py.detach(|| self.engine.wake(dir));
        Ok(())
    }

    /// Issues one transfer of several KV-cache groups as one batch with one result.
    ///
    /// ``groups``: one ``(src_table, src_ids, dst_table, dst_ids, skip)`` per group. With
    /// ``skip=None`` both sides are named by table blocks, as in :meth:`submit_blocks`. With an
    /// int, the side whose table was registered with ``unit`` > 1 is named by *chunk* ids (a
    /// CPU block of ``unit`` sub-blocks): the group moves ``len(other side's ids)`` blocks, from
    /// sub-block ``skip`` of the first chunk on, so it needs ``ceil((skip + n) / unit)`` chunk
    /// ids (the first and the last chunk may be partial). A group may be empty on both sides.
    /// The core checks every id, every chunk count and that destinations are distinct, across
    /// groups too. Ids may be int32 arrays (vLLM's), taken as they are.
    ///
    /// ``route`` (a :class:`blockswap.Route`; ``None``: ``Route.pages()``) says how it moves:
    /// ``Route.pages(...)`` a descriptor per page as :meth:`submit`, the small ones by a copy
    /// kernel where it names one (the core's, from :meth:`load_kernel`, launched with no Python
    /// on the way; on the host backend, which loads none, by memcpy); ``Route.blocks()`` each
    /// pair's block plan (:meth:`block_runs`, copy engines only); ``Route.staged(kernel)`` the
    /// staged plan (a host side that is block-major, see :meth:`staged_row`): each block's row
    /// crosses PCIe as one copy into or out of a device staging ring of two ``stage_bytes``
    /// slots, and the staged kernel moves its pages between the ring and the GPU pages;
    /// ``Route.staged(kernel, direct=True, launch_bytes=n)`` the direct plan (a host side in
    /// chunks or cells): the staged kernel moves every page between host memory and the GPU in
    /// place, at most ``n`` bytes of pages a launch.
    // `wait_stream` and `route` may be passed by position: the handler's hot path does, as
    // keywords cost a quarter of a µs a call here.
    #[pyo3(signature = (job_id, groups, direction = Given(None), wait_stream = None, route = None),
        text_signature = "(self, job_id, groups, direction='h2d', wait_stream=None, route=None)")]
    fn submit_groups(
        &self,
        py: Python<'_>,
        job_id: &Bound<'_, PyAny>,
        groups: &Bound<'_, PyAny>,
        direction: Given<'_>,
        wait_stream: Option<&Bound<'_, PyAny>>,
        route: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        not_launching("submit_groups")?;
        let job_id = args::job_id(job_id)?;
        let (dir, wait_stream, _) = submission(&direction, wait_stream, &Given(None))?;
        let (tables, ids) = submit::groups(groups, dir)?;
        let gs = submit::group_ids(&tables, &ids);
        submit::issue_groups(&self.engine, py, job_id, &gs, dir, wait_stream, route)
    }

    /// :meth:`submit_groups` of one group whose chunk side starts at the first block's index in
    /// its request (``block_index``, vLLM's ``block_indices[0]``; ``None``: a store from its
    /// first chunk's start, a load to its last chunk's end), the skip worked out here: the usual
    /// transfer of a KV cache of one group, in one call. The engine's thread for ``direction``
    /// is woken first, as :meth:`wake` would (before the ids are read). ``src_ids`` /
    /// ``dst_ids`` as in :meth:`submit_groups`; a refusal names the ids as one group's.
    // Positional, as `submit_groups`: the handler's and the plug-in's hot path.
    #[pyo3(signature = (job_id, src_table, src_ids, dst_table, dst_ids, block_index = None,
        direction = Given(None), wait_stream = None, route = None),
        text_signature = "(self, job_id, src_table, src_ids, dst_table, dst_ids, \
            block_index=None, direction='h2d', wait_stream=None, route=None)")]
    #[allow(clippy::too_many_arguments)]
    fn submit_group(
        &self,
        py: Python<'_>,
        job_id: &Bound<'_, PyAny>,
        src_table: &Bound<'_, PyAny>,
        src_ids: &Bound<'_, PyAny>,
        dst_table: &Bound<'_, PyAny>,
        dst_ids: &Bound<'_, PyAny>,
        block_index: Option<&Bound<'_, PyAny>>,
        direction: Given<'_>,
        wait_stream: Option<&Bound<'_, PyAny>>,
        route: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        not_launching("submit_group")?;
        let job_id = args::job_id(job_id)?;
        let (dir, wait_stream, _) = submission(&direction, wait_stream, &Given(None))?;
        // Woken while the ids are read; detached, as in `wake`.
        py.detach(|| self.engine.wake(dir));
        let block_index = args::opt_int("block_index", block_index, U64)?;
        let src_ids = args::ids_named(|| submit::ids_name(dir.src_kind()).to_owned(), src_ids)?;
        let dst_ids = args::ids_named(|| submit::ids_name(dir.dst_kind()).to_owned(), dst_ids)?;
        let g = GroupIds {
            src_table: args::table_id(src_table)?,
            src_ids: &src_ids,
            dst_table: args::table_id(dst_table)?,
            dst_ids: &dst_ids,
            chunks: Chunks::Index(block_index),
        };
        submit::issue_groups(&self.engine, py, job_id, &[g], dir, wait_stream, route)
    }

    /// :meth:`submit_groups` of a connector's spec as it gives it (vLLM's): ``gpu_ids`` and
    /// ``cpu_ids`` (CPU chunk ids) flat, group after group, ``group_sizes`` and ``block_indices``
    /// per group, and per group its ``(src_table, dst_table)`` pairs in ``tables``: none (a group
    /// without pages), one (chunk ids on a table that counts chunks of ``blocks_per_chunk``), or
    /// one per sub-block of a chunk (pair ``j`` holds sub-block ``j`` of every chunk, as a shared
    /// region's cells lay them), the skip in each group's first chunk from its block index. The
    /// engine's thread is woken first. Refusals name the count or the ids that are wrong.
    #[pyo3(signature = (job_id, gpu_ids, cpu_ids, group_sizes, block_indices, tables,
        blocks_per_chunk, direction = Given(None), wait_stream = None, route = None),
        text_signature = "(self, job_id, gpu_ids, cpu_ids, group_sizes, block_indices, tables, \
            blocks_per_chunk, direction='h2d', wait_stream=None, route=None)")]
    #[allow(clippy::too_many_arguments)]
    fn submit_spec(
        &self,
        py: Python<'_>,
        job_id: &Bound<'_, PyAny>,
        gpu_ids: &Bound<'_, PyAny>,
        cpu_ids: &Bound<'_, PyAny>,
        group_sizes: &Bound<'_, PyAny>,
        block_indices: &Bound<'_, PyAny>,
        tables: &Bound<'_, PyAny>,
        blocks_per_chunk: &Bound<'_, PyAny>,
        direction: Given<'_>,
        wait_stream: Option<&Bound<'_, PyAny>>,
        route: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        not_launching("submit_spec")?;
        let job_id = args::job_id(job_id)?;
        let (dir, wait_stream, _) = submission(&direction, wait_stream, &Given(None))?;
        py.detach(|| self.engine.wake(dir));
        let unit = args::int(
            "blocks_per_chunk",
            blocks_per_chunk,
            IntArg::within(1, U64_MAX),
        )?;
        let (t, ids) = submit::spec_groups(
            gpu_ids,
            cpu_ids,
            group_sizes,
            block_indices,
            tables,
            unit,
            dir,
        )?;
        let gs = submit::spec_group_ids(&t, &ids, unit);
        submit::issue_groups(&self.engine, py, job_id, &gs, dir, wait_stream, route)
    }

    /// Makes a compiled copy kernel launchable by the core: ``kernel`` as
    /// :func:`blockswap.kernels.core_kernel` returns it (which keeps the compiled module, and
    /// must be kept alive as long as the engine may launch it): ``function`` a ``CUfunction``
    /// loaded in the device's primary context, ``threads`` per CTA, ``shared`` bytes of dynamic
    /// shared memory, ``params`` the names of its leading parameters, ``rows`` descriptors per
    /// CTA step, ``ctas`` the most CTAs, ``row_bytes`` and ``chained`` for the staged plan's. A
    /// page kernel for the kernel route (``Route.pages(below, kernel=id)``), or the staged
    /// plan's (``Route.staged(id)``). Returns the id for :meth:`submit_groups`' route, or
    /// ``None`` on the host backend. A kernel whose parameters are neither kind's raises
    /// :class:`blockswap.BackendError`.
    fn load_kernel(&self, py: Python<'_>, kernel: &Bound<'_, PyDict>) -> PyResult<Option<u32>> {
        not_launching("load_kernel")?;
        let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
            kernel
                .get_item(k)?
                .ok_or_else(|| invalid(format!("the kernel has no {k:?}")))
        };
        let opt = |k: &str| kernel.get_item(k);
        let params = get("params")?
            .extract::<Vec<String>>()?
            .iter()
            .map(|p| p.parse::<KernelParam>().map_err(invalid))
            .collect::<PyResult<Vec<_>>>()?;
        let spec = KernelSpec {
            function: get("function")?.extract()?,
            threads: get("threads")?.extract()?,
            shared: get("shared")?.extract()?,
            params,
            rows: get("rows")?.extract()?,
            ctas: get("ctas")?.extract()?,
            row_bytes: opt("row_bytes")?.map_or(Ok(0), |v| v.extract())?,
            chained: opt("chained")?.map_or(Ok(false), |v| v.extract())?,
        };
        Ok(py.detach(|| self.engine.load_kernel(spec))?)
    }

    /// The bytes of one block's row where ``table`` is block-major (every page of a block in
    /// one chunk inside one registered region): what the staged plan moves across PCIe per
    /// block, at most :attr:`stage_bytes`. ``None`` for any other layout.
    fn staged_row(&self, py: Python<'_>, table: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
        not_launching("staged_row")?;
        let table = args::table_id(table)?;
        // The engine lock: taken with the GIL released (see `register_table`).
        Ok(py.detach(|| self.engine.staged_row(table))?)
    }

    /// Makes ``direction``'s staging resources now (``"h2d"`` or ``"d2h"``): its kernel stream
    /// and events, with ``ring`` (``None``: True) its two :attr:`stage_bytes` slots in device
    /// memory, CPU -> GPU the device buffers of its transfers' block entries. Otherwise its
    /// first staged transfer makes them, and waits for them (0.3-0.7 ms on an H200; the
    /// direction's issuing thread starts with the engine). What is made already stays. Nothing
    /// on the host backend; :class:`blockswap.BackendError` where the device memory cannot be
    /// had.
    #[pyo3(signature = (direction, ring = None))]
    fn prepare_staged(
        &self,
        py: Python<'_>,
        direction: &Bound<'_, PyAny>,
        ring: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        not_launching("prepare_staged")?;
        let dir = direction_arg(direction)?;
        let ring = ring.map_or(Ok(true), |r| args::flag("ring", r))?;
        // Detached: device allocations take a while, and the lane's stage lock is the engine
        // thread's too.
        Ok(py.detach(|| self.engine.prepare_staged(dir, ring))?)
    }

    /// Bytes of each of the two slots of a direction's staging ring (the ``stage_bytes``
    /// option), allocated in device memory on the direction's first staged transfer, or by
    /// :meth:`prepare_staged`.
    #[getter]
    fn stage_bytes(&self) -> u64 {
        self.engine.stage_bytes()
    }

    /// The block plan of two block tables: one ``(first segment, rows, width, source pitch,
    /// destination pitch)`` per 2-D copy a block takes (consecutive segments whose pages lie at
    /// one pitch on both sides), or ``None`` where the pair has none (pages that differ,
    /// destination pages that may share bytes). A block-major CPU table against layer tensors
    /// at one pitch is one copy per block.
    #[pyo3(signature = (src_table, dst_table, direction = Given(None)),
        text_signature = "(self, src_table, dst_table, direction='h2d')")]
    #[allow(clippy::type_complexity)]
    fn block_runs(
        &self,
        py: Python<'_>,
        src_table: &Bound<'_, PyAny>,
        dst_table: &Bound<'_, PyAny>,
        direction: Given<'_>,
    ) -> PyResult<Option<Vec<(usize, u64, u64, u64, u64)>>> {
        not_launching("block_runs")?;
        let (src_table, dst_table) = (args::table_id(src_table)?, args::table_id(dst_table)?);
        let dir = direction.or(Direction::HostToDevice, direction_arg)?;
        let runs = py.detach(|| self.engine.block_runs(src_table, dst_table, dir))?;
        Ok(runs.map(|rs| {
            rs.iter()
                .map(|r| (r.first, r.rows, r.width, r.src_pitch, r.dst_pitch))
                .collect()
        }))
    }

    /// Whether a cache whose KV-cache groups are the table pairs ``pairs`` (source,
    /// destination as ``direction`` moves them) takes the block route (``Route.blocks()``): by
    /// default where each group's plan (:meth:`block_runs`) is at most
    /// ``blockswap._core.BLOCK_MAX_COPIES`` 2-D copies of pages of at least ``BLOCK_MIN_PAGE``
    /// bytes, with ``insist`` wherever it saves a copy, never where two groups share memory.
    /// Returns ``(taken, why)``.
    #[pyo3(signature = (pairs, direction = Given(None), *, insist = Given(None)),
        text_signature = "(self, pairs, direction='h2d', *, insist=False)")]
    fn block_route(
        &self,
        py: Python<'_>,
        pairs: &Bound<'_, PyAny>,
        direction: Given<'_>,
        insist: Given<'_>,
    ) -> PyResult<(bool, String)> {
        not_launching("block_route")?;
        let pairs = pairs
            .try_iter()?
            .map(|p| {
                let (s, d): (Bound<'_, PyAny>, Bound<'_, PyAny>) = p?.extract()?;
                Ok((args::table_id(&s)?, args::table_id(&d)?))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let dir = direction.or(Direction::HostToDevice, direction_arg)?;
        let insist = insist.or(false, |v| args::flag("insist", v))?;
        let route = py.detach(|| self.engine.block_route(&pairs, dir, insist))?;
        Ok(match route {
            Ok(why) => (true, why),
            Err(why) => (false, why),
        })
    }

    /// Whether a cache whose KV-cache groups have the host tables ``host_tables`` takes the
    /// staged plan (``Route.staged(...)``) with this engine's slots: every table block-major
    /// (:meth:`staged_row`) with rows no larger than :attr:`stage_bytes`. Returns ``(the largest
    /// row, "")``, or ``(None, why not)``.
    fn staged_route(
        &self,
        py: Python<'_>,
        host_tables: &Bound<'_, PyAny>,
    ) -> PyResult<(Option<u64>, String)> {
        not_launching("staged_route")?;
        let host_tables = args::table_ids(host_tables)?;
        let route = py.detach(|| self.engine.staged_route(&host_tables))?;
        Ok(match route {
            Ok(row) => (Some(row), String::new()),
            Err(why) => (None, why),
        })
    }

    /// The results of the transfers finished since the last call, each reported once.
    /// Lock-free; never blocks.
    fn get_finished(&self) -> Vec<PyTransferResult> {
        let mut out = Vec::new();
        self.engine.get_finished(&mut out);
        out.into_iter().map(Into::into).collect()
    }

    /// Blocks (GIL released, no spinning) until the listed jobs finished; their results still
    /// come from :meth:`get_finished`. Ids never submitted (or already reported) are not waited
    /// for. ``timeout`` in seconds (None or ``math.inf``: no limit); past it, a
    /// :class:`~blockswap.WaitTimeoutError`.
    #[pyo3(signature = (job_ids, timeout = None))]
    fn wait(
        &self,
        py: Python<'_>,
        job_ids: &Bound<'_, PyAny>,
        timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        not_launching("wait")?;
        let ids = args::job_ids(job_ids)?;
        let timeout = match timeout {
            Some(t) if !t.is_none() => Some(
                engine::seconds("timeout", args::seconds("timeout", t)?)
                    .map_err(EngineError::from)?,
            ),
            _ => None,
        };
        Ok(py.detach(|| self.engine.wait(&ids, timeout))?)
    }

    /// Waits for transfers in flight and stops the backend; results stay available. Transfers
    /// still in flight after the engine's ``shutdown_timeout`` are reported failed. Idempotent.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        not_launching("shutdown")?;
        py.detach(|| self.engine.shutdown());
        Ok(())
    }

    #[getter]
    fn is_shut_down(&self) -> bool {
        self.engine.is_shut_down()
    }

    /// Registers ``nbytes`` at ``ptr`` as ``kind`` memory that transfers may use (what
    /// :meth:`blockswap.Engine.register` calls): the caller vouches that the memory stays
    /// allocated until unregistered.
    fn _register(
        &self,
        py: Python<'_>,
        ptr: &Bound<'_, PyAny>,
        nbytes: &Bound<'_, PyAny>,
        kind: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        not_launching("register")?;
        let ptr: u64 = args::int("ptr", ptr, U64)?;
        let kind = kind_arg(kind)?;
        let nbytes: u64 = args::int("nbytes", nbytes, IntArg::within(1, U64_MAX))?;
        // SAFETY: the Python caller vouches for the range (documented on Engine.register); the
        // Python layer registers only memory of objects it keeps alive.
        py.detach(|| unsafe { self.engine.register(ptr, nbytes, kind) })
            .map_err(Into::into)
    }

    /// Page-locks ``nbytes`` of existing host memory at ``ptr`` (``cuMemHostRegister`` on CUDA)
    /// and registers it as host memory (what :meth:`blockswap.Engine.pin` calls).
    fn _pin(&self, py: Python<'_>, ptr: u64, nbytes: &Bound<'_, PyAny>) -> PyResult<()> {
        not_launching("pin")?;
        let nbytes: u64 = args::int("nbytes", nbytes, IntArg::within(1, U64_MAX))?;
        // SAFETY: as for `register`: the Python caller vouches for the range.
        py.detach(|| unsafe { self.engine.pin(ptr, nbytes) })
            .map_err(Into::into)
    }

    /// Removes the registration at ``ptr`` (what :meth:`blockswap.Engine.unregister` calls).
    fn _unregister(&self, py: Python<'_>, ptr: &Bound<'_, PyAny>) -> PyResult<()> {
        not_launching("unregister")?;
        let ptr: u64 = args::int("ptr", ptr, U64)?;
        Ok(py.detach(|| self.engine.unregister(ptr))?)
    }

    /// Allocates ``nbytes`` of host memory (page-locked on CUDA), registered; returns its
    /// address (what :meth:`blockswap.Engine.alloc_host` calls).
    fn _alloc_host(&self, py: Python<'_>, nbytes: &Bound<'_, PyAny>) -> PyResult<u64> {
        not_launching("alloc_host")?;
        let nbytes: usize = args::int("nbytes", nbytes, IntArg::within(1, U64_MAX))?;
        Ok(py.detach(|| self.engine.alloc_host(nbytes))?)
    }

    /// Frees the buffer at ``ptr`` from ``_alloc_host`` (what
    /// :meth:`blockswap.Engine.free_host` calls).
    fn _free_host(&self, py: Python<'_>, ptr: u64) -> PyResult<()> {
        not_launching("free_host")?;
        py.detach(|| self.engine.free_host(ptr)).map_err(Into::into)
    }

    /// Host backend: the next ``count`` transfers fail halfway (for tests; CUDA: the driver is
    /// handed a null address there and refuses it).
    fn inject_failures(&self, count: &Bound<'_, PyAny>) -> PyResult<()> {
        self.engine.inject_failures(args::int("count", count, U64)?);
        Ok(())
    }

    /// Counters: bytes, seconds and GB/s per direction, transfers in flight, host time spent
    /// submitting (``submit_ns``), validating (``prepare_ns``) and in driver copy calls
    /// (``driver_ns``), and the descriptor pool.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        super::stats::stats(py, &self.engine)
    }

    /// The backend, driver, device, copy path and completion mechanism in use, and the
    /// engine's settings.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        super::stats::info(py, &self.engine)
    }
}
