//! `Route`: how a transfer moves ([`crate::engine::Route`]), as one frozen Python object that
//! `submit_groups` takes back, and why it was chosen. Its constructors check that the route is
//! one the core can take; `choose_route` picks a handler's by the core's rule
//! ([`choice::candidates`]), loading a copy kernel through the caller where one needs it.

use pyo3::prelude::*;

use super::args::{self, IntArg};
use super::{call_launcher, invalid};
use crate::direction::Direction;
use crate::engine;
use crate::kernel::{KernelBatch, KernelLauncher, PageKernel};
use crate::plan::{choice, Plan};

/// What moves the small pages of a page route.
enum Kernel {
    /// A Python callable launched on the submitting thread with the batch.
    Launcher(Py<PyAny>),
    /// A kernel from `Engine.load_kernel`, launched by the core; `None`: one launch per transfer.
    Loaded {
        kernel: u32,
        launch_bytes: Option<u64>,
    },
}

impl Kernel {
    fn clone_ref(&self, py: Python<'_>) -> Self {
        match self {
            Kernel::Launcher(l) => Kernel::Launcher(l.clone_ref(py)),
            Kernel::Loaded {
                kernel,
                launch_bytes,
            } => Kernel::Loaded {
                kernel: *kernel,
                launch_bytes: *launch_bytes,
            },
        }
    }
}

/// How a transfer moves: `Route.pages(...)`, `Route.blocks()` or `Route.staged(...)`.
#[pyclass(name = "Route", module = "blockswap._core", frozen)]
pub(super) struct PyRoute {
    plan: Plan<Option<(u64, Kernel)>, (), engine::StagedRoute>,
    /// What chose the route (empty for one built by its constructors).
    reason: String,
}

/// An optional int argument in `[0, hi]` (None passes), or the typed error naming it.
fn optional_int_arg(
    value: Option<&Bound<'_, PyAny>>,
    name: &str,
    hi: u64,
) -> PyResult<Option<u64>> {
    args::opt_int(name, value, IntArg::within(0, i128::from(hi)))
}

#[pymethods]
impl PyRoute {
    /// A descriptor per page, by the copy engines; with `kernel_below` > 0 the pages below that
    /// many bytes (after coalescing) by a copy kernel instead: the core's `kernel` (an id from
    /// `Engine.load_kernel`, at most `launch_bytes` a launch, None: one launch) or `launcher`'s
    /// (a callable taking `(src, dst, size, len, max_size, alignment, stream)`), exactly one.
    #[staticmethod]
    #[pyo3(signature = (kernel_below = None, *, kernel = None, launch_bytes = None, launcher = None))]
    fn pages(
        kernel_below: Option<&Bound<'_, PyAny>>,
        kernel: Option<&Bound<'_, PyAny>>,
        launch_bytes: Option<&Bound<'_, PyAny>>,
        launcher: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let below = optional_int_arg(kernel_below, "kernel_below", u64::MAX)?.unwrap_or(0);
        let kernel = optional_int_arg(kernel, "kernel", u64::from(u32::MAX))?
            .map(|k| u32::try_from(k).expect("checked above"));
        let launch_bytes = optional_int_arg(launch_bytes, "launch_bytes", u64::MAX)?;
        let launcher = launcher.filter(|l| !l.is_none());
        if let Some(l) = launcher {
            if !l.is_callable() {
                return Err(invalid(format!(
                    "launcher must be a callable, not {}",
                    l.get_type().name()?
                )));
            }
        }
        let kernel =
            match (kernel, launcher) {
                (Some(_), Some(_)) => return Err(invalid(
                    "a page route's kernel is the core's (kernel=) or a launcher's (launcher=), \
                     not both",
                )),
                (Some(kernel), None) => Some(Kernel::Loaded {
                    kernel,
                    launch_bytes,
                }),
                (None, Some(l)) if launch_bytes.is_none() => {
                    Some(Kernel::Launcher(l.clone().unbind()))
                }
                (None, Some(_)) => return Err(invalid(
                    "launch_bytes bounds the core's launches (kernel=): a launcher slices its own",
                )),
                (None, None) if launch_bytes.is_some() => {
                    return Err(invalid("launch_bytes needs a kernel (kernel=) to bound"))
                }
                (None, None) => None,
            };
        let pages = match (below, kernel) {
            (0, None) => None,
            (0, Some(_)) => {
                return Err(invalid(
                    "kernel_below is 0: no page would go to the kernel (give the page size \
                     below which pages take it)",
                ))
            }
            (below, Some(k)) => Some((below, k)),
            (below, None) => {
                return Err(invalid(format!(
                    "kernel_below={below} needs a kernel (kernel=) or a launcher (launcher=)"
                )))
            }
        };
        Ok(PyRoute::new(Plan::Pages(pages)))
    }

    /// Each block as the 2-D copies of its table pair's block plan (`Engine.block_runs`), copy
    /// engines only; refused at submission where a pair has none.
    #[staticmethod]
    fn blocks() -> Self {
        PyRoute::new(Plan::Runs(()))
    }

    /// The staged plan: each block's host row across `PCIe` as one copy into or out of a device
    /// staging ring, its pages moved inside the GPU by `kernel` (a staged kernel's id from
    /// `Engine.load_kernel`; None on the host backend, which copies with memcpy). With `direct`
    /// (a bool; None: false) the kernel moves the host pages in place instead, no row crossing
    /// by the copy engines, at most `launch_bytes` of pages a launch (None: a launch per run of
    /// one geometry).
    #[staticmethod]
    #[pyo3(signature = (kernel = None, direct = None, launch_bytes = None))]
    fn staged(
        kernel: Option<&Bound<'_, PyAny>>,
        direct: Option<&Bound<'_, PyAny>>,
        launch_bytes: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let kernel = optional_int_arg(kernel, "kernel", u64::from(u32::MAX))?
            .map(|k| u32::try_from(k).expect("checked above"));
        let direct = direct.map_or(Ok(false), |d| args::flag("direct", d))?;
        let launch_bytes = optional_int_arg(launch_bytes, "launch_bytes", u64::MAX)?;
        if launch_bytes.is_some() && !direct {
            return Err(invalid(
                "launch_bytes bounds the direct plan's launches (direct=True): the staged plan's \
                 steps are its slots",
            ));
        }
        Ok(PyRoute::new(Plan::Staged(engine::StagedRoute {
            kernel,
            direct,
            launch_bytes,
        })))
    }

    /// What chose the route: the core's reason for a route [`choose_route`] chose, a
    /// calibration's result, or as [`PyRoute::with_reason`] set it (empty for one built by the
    /// constructors).
    #[getter]
    fn reason(&self) -> &str {
        &self.reason
    }

    /// The same route with `reason` as what chose it.
    fn with_reason(&self, py: Python<'_>, reason: String) -> Self {
        let plan = match &self.plan {
            Plan::Pages(p) => Plan::Pages(p.as_ref().map(|(below, k)| (*below, k.clone_ref(py)))),
            Plan::Runs(()) => Plan::Runs(()),
            Plan::Staged(s) => Plan::Staged(*s),
        };
        PyRoute { plan, reason }
    }

    /// `"pages"`, `"blocks"`, `"staged"` or `"direct"` (the staged plan's kernel on the host
    /// pages in place).
    #[getter]
    fn plan(&self) -> &'static str {
        match &self.plan {
            Plan::Staged(s) if s.direct => "direct",
            p => p.name(),
        }
    }

    /// Pages below this many bytes go to the kernel (0: none; the page route only).
    #[getter]
    fn kernel_below(&self) -> u64 {
        match &self.plan {
            Plan::Pages(Some((below, _))) => *below,
            _ => 0,
        }
    }

    /// The core's kernel id (page or staged kernel), if any.
    #[getter]
    fn kernel(&self) -> Option<u32> {
        match &self.plan {
            Plan::Pages(Some((_, Kernel::Loaded { kernel, .. }))) => Some(*kernel),
            Plan::Staged(s) => s.kernel,
            _ => None,
        }
    }

    /// The most one launch of the core's page kernel, or of the direct plan's kernel, moves
    /// (None: one launch per transfer, or per run of one geometry).
    #[getter]
    fn launch_bytes(&self) -> Option<u64> {
        match &self.plan {
            Plan::Pages(Some((_, Kernel::Loaded { launch_bytes, .. }))) => *launch_bytes,
            Plan::Staged(s) => s.launch_bytes,
            _ => None,
        }
    }

    /// The Python launcher of the page route's kernel, if any.
    #[getter]
    fn launcher(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        match &self.plan {
            Plan::Pages(Some((_, Kernel::Launcher(l)))) => Some(l.clone_ref(py)),
            _ => None,
        }
    }

    fn __repr__(&self) -> String {
        match &self.plan {
            Plan::Pages(None) => "Route.pages()".into(),
            Plan::Pages(Some((below, Kernel::Launcher(_)))) => {
                format!("Route.pages({below}, launcher=...)")
            }
            Plan::Pages(Some((
                below,
                Kernel::Loaded {
                    kernel,
                    launch_bytes,
                },
            ))) => {
                let lb = launch_bytes.map_or("None".into(), |b| b.to_string());
                format!("Route.pages({below}, kernel={kernel}, launch_bytes={lb})")
            }
            Plan::Runs(()) => "Route.blocks()".into(),
            Plan::Staged(s) => {
                let k = s.kernel.map_or("None".into(), |k| k.to_string());
                let direct = match (s.direct, s.launch_bytes) {
                    (false, _) => String::new(),
                    (true, None) => ", direct=True".into(),
                    (true, Some(b)) => format!(", direct=True, launch_bytes={b}"),
                };
                format!("Route.staged(kernel={k}{direct})")
            }
        }
    }
}

impl PyRoute {
    fn new(plan: Plan<Option<(u64, Kernel)>, (), engine::StagedRoute>) -> Self {
        PyRoute {
            plan,
            reason: String::new(),
        }
    }

    /// The Python launcher, if the route has one: what [`PyRoute::core`]'s launcher calls.
    pub(super) fn python_launcher(&self) -> Option<&Py<PyAny>> {
        match &self.plan {
            Plan::Pages(Some((_, Kernel::Launcher(l)))) => Some(l),
            _ => None,
        }
    }

    /// The engine's form of the route, with `launch` standing for the Python launcher.
    pub(super) fn core<'a>(&self, launch: KernelLauncher<'a>) -> engine::Route<'a> {
        match &self.plan {
            Plan::Pages(None) => Plan::Pages(None),
            Plan::Pages(Some((below, kernel))) => {
                let k = match kernel {
                    Kernel::Launcher(_) => PageKernel::Launcher(launch),
                    Kernel::Loaded {
                        kernel,
                        launch_bytes,
                    } => PageKernel::Loaded {
                        kernel: *kernel,
                        launch_bytes: launch_bytes.unwrap_or(u64::MAX),
                    },
                };
                Plan::Pages(Some((*below, k)))
            }
            Plan::Runs(()) => Plan::Runs(()),
            Plan::Staged(s) => Plan::Staged(*s),
        }
    }
}

/// Calls the route's Python launcher (taking the GIL) for a transfer; only reached for a route
/// that has one.
pub(super) fn launch_with(route: &PyRoute, batch: KernelBatch) -> Result<(), String> {
    match route.python_launcher() {
        Some(l) => call_launcher(l, batch),
        None => Err("the route has no launcher".into()),
    }
}

/// The route of one direction of a handler: the first of the core's ranked candidates
/// ([`choice::candidates`]) that can be built here, with its reason.
///
/// `tables` holds each group's (GPU table, CPU table) ids in `engine`, which the block and staged
/// plans' rules read, and whose CPU tables say whether the cache is block-major
/// ([`crate::engine::Engine::block_major`]). `kernel_unavailable()` says why the copy kernel
/// cannot run in this process (called at most once, where the choice needs it). A candidate
/// whose kernel the core launches is built with `load_kernel(max_size, ctas, staged)`'s
/// `(kernel id, "")`, and passed over (with why) where it gives `(None, why not)` or is None; a
/// page kernel with no core to launch it is `launcher()`'s. `note(line)` hears each route passed
/// over and why. `errors` are the classes of a refusal: `(unavailable, refused)`, the first made
/// as `unavailable(path, why)` (`path="kernel"` where the kernel cannot run), the second as
/// `refused(message)` (a path the geometry gives no plan for, or none that could be built).
#[pyfunction]
#[pyo3(signature = (
    direction, path, *, on_cuda, page_sizes, errors, kernel_below = None, kernel_ctas = 16,
    launch_bytes = None, kernel_unavailable = None, engine = None, tables = None,
    load_kernel = None, launcher = None, note = None
))]
#[allow(clippy::too_many_arguments, clippy::too_many_lines)]
pub(super) fn choose_route(
    py: Python<'_>,
    direction: &str,
    path: &str,
    on_cuda: bool,
    page_sizes: Vec<u64>,
    errors: (Bound<'_, PyAny>, Bound<'_, PyAny>),
    kernel_below: Option<u64>,
    kernel_ctas: u32,
    launch_bytes: Option<u64>,
    kernel_unavailable: Option<&Bound<'_, PyAny>>,
    engine: Option<PyRef<'_, super::PyEngine>>,
    tables: Option<Vec<(u32, u32)>>,
    load_kernel: Option<&Bound<'_, PyAny>>,
    launcher: Option<&Bound<'_, PyAny>>,
    note: Option<&Bound<'_, PyAny>>,
) -> PyResult<PyRoute> {
    let dir = super::direction(direction)?;
    let engine = engine.as_deref().map(|e| &*e.engine);
    if engine.is_some() {
        // Its queries take the engine's submit lock, which a launcher's submission holds.
        super::not_launching("choose_route")?;
    }
    let tables = tables.unwrap_or_default();
    let host: Vec<u32> = tables.iter().map(|&(_, c)| c).collect();
    let block_major = match engine {
        Some(e) => py.detach(|| e.block_major(&host))?,
        None => false,
    };
    let ask = choice::Ask {
        path: choice::Path::parse(path).ok_or_else(|| {
            invalid(format!(
                "path must be one of {:?}, not {path:?}",
                choice::Path::ALL.map(choice::Path::as_str)
            ))
        })?,
        on_cuda,
        block_major,
        kernel_below,
        kernel_ctas,
    };
    let no_engine = || "no engine to read the cache's tables from".to_string();
    let block = |insist: bool| -> PyResult<Result<String, String>> {
        let Some(e) = engine else {
            return Ok(Err(no_engine()));
        };
        let pairs: Vec<(u32, u32)> = tables
            .iter()
            .map(|&(g, c)| {
                if dir == Direction::DeviceToHost {
                    (g, c)
                } else {
                    (c, g)
                }
            })
            .collect();
        Ok(py.detach(|| e.block_route(&pairs, dir, insist))?)
    };
    let staged = || -> PyResult<Result<(u64, u64), String>> {
        let Some(e) = engine else {
            return Ok(Err(no_engine()));
        };
        let fit = py.detach(|| e.staged_route(&host))?;
        Ok(fit.map(|row| (row, e.stage_bytes())))
    };
    let direct = || -> PyResult<Result<u64, String>> {
        let Some(e) = engine else {
            return Ok(Err(no_engine()));
        };
        Ok(py.detach(|| e.direct_route(&host))?)
    };
    let unavailable = || -> PyResult<Option<String>> {
        kernel_unavailable.map_or(Ok(None), |f| f.call0()?.extract())
    };
    let rules = choice::Rules {
        block,
        staged,
        direct,
        unavailable,
    };
    let (unavailable_error, refused_error) = errors;
    let refuse = |e: Bound<'_, PyAny>| PyErr::from_value(e);
    let ranking = match choice::candidates(&ask, dir, &page_sizes, rules)? {
        Ok(r) => r,
        Err(choice::Refusal::Unavailable(why)) => {
            return Err(refuse(unavailable_error.call1((path, why))?))
        }
        Err(choice::Refusal::Refused(why)) => return Err(refuse(refused_error.call1((why,))?)),
    };
    let say = |line: String| note.map_or(Ok(()), |n| n.call1((line,)).map(drop));
    for why in ranking.declined {
        say(why)?;
    }
    let mut passed = Vec::new();
    for c in ranking.choices {
        let need = match c.candidate {
            choice::Candidate::Kernel { load, .. } | choice::Candidate::Staged { load } => load,
            choice::Candidate::Direct { load } => Some(load),
            choice::Candidate::Dma | choice::Candidate::Blocks => None,
        };
        let mut kernel = None;
        if let Some(k) = need {
            let Some(load) = load_kernel else { continue };
            let (id, why): (Option<u32>, String) =
                load.call1((k.max_size, k.ctas, k.staged))?.extract()?;
            if id.is_none() {
                say(format!("passed over {}: {why}", c.reason))?;
                passed.push(why);
                continue;
            }
            kernel = id;
        }
        let staged = |direct: bool, launch_bytes: Option<u64>| {
            Plan::Staged(engine::StagedRoute {
                kernel,
                direct,
                launch_bytes,
            })
        };
        let plan = match c.candidate {
            choice::Candidate::Dma => Plan::Pages(None),
            choice::Candidate::Blocks => Plan::Runs(()),
            choice::Candidate::Staged { .. } => staged(false, None),
            choice::Candidate::Direct { .. } => staged(true, launch_bytes),
            choice::Candidate::Kernel { below, .. } => {
                let k = match (kernel, launcher) {
                    (Some(kernel), _) => Kernel::Loaded {
                        kernel,
                        launch_bytes,
                    },
                    (None, Some(make)) => Kernel::Launcher(make.call0()?.unbind()),
                    (None, None) => continue,
                };
                Plan::Pages(Some((below, k)))
            }
        };
        return Ok(PyRoute {
            plan,
            reason: c.reason,
        });
    }
    Err(refuse(refused_error.call1((format!(
        "path='{path}' is not possible here: {}",
        passed.join("; ")
    ),))?))
}
