//! Arguments as Python hands them over, checked and converted in one place with one wording:
//! `"<name> must be an int from 1 to 16384, not 0"`, `"<name> must be a bool, not 'no'"`.
//!
//! A value of the wrong type is an `ArgumentTypeError` (an `InvalidTransferError` and a
//! `TypeError`, as Python's own are); an int outside what the core takes is an
//! `InvalidTransferError`. The Python layer's own settings (the handlers', the plug-in's) call
//! [`check_int`] through `blockswap._checks` with their own two error classes, so every int
//! argument of the package is refused in these words.

use numpy::{PyArrayDescrMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyString, PyTuple, PyType};

use super::{direction, invalid, InvalidTransferError};
use crate::affinity::Cpus;
use crate::direction::Direction;
use crate::region::MemoryKind;

/// The largest u64, as the bound of an int argument.
pub(super) const U64_MAX: i128 = u64::MAX as i128;

static ARGUMENT_TYPE_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
/// numpy's `integer`, `floating`, `bool_` and `generic`.
static NUMPY_TYPES: PyOnceLock<[Py<PyType>; 4]> = PyOnceLock::new();

/// `blockswap.ArgumentTypeError`: made once, a subclass of `InvalidTransferError` and
/// `TypeError`.
pub(super) fn argument_type_error(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    ARGUMENT_TYPE_ERROR
        .get_or_try_init(py, || {
            let bases = PyTuple::new(
                py,
                [
                    py.get_type::<InvalidTransferError>(),
                    py.get_type::<PyTypeError>(),
                ],
            )?;
            let ns = PyDict::new(py);
            ns.set_item("__module__", "blockswap")?;
            ns.set_item(
                "__doc__",
                "An argument of the wrong type: refused before anything was issued, like any \
                 :class:`~blockswap.InvalidTransferError`, and a ``TypeError`` too, as \
                 Python's own are.",
            )?;
            let t = py
                .get_type::<PyType>()
                .call1(("ArgumentTypeError", bases, ns))?;
            Ok::<_, PyErr>(t.cast_into::<PyType>()?.unbind())
        })
        .map(|t| t.bind(py))
}

/// numpy's `integer`, `floating`, `bool_` and `generic` (imported once).
fn numpy_types(py: Python<'_>) -> PyResult<[&Bound<'_, PyType>; 4]> {
    let t = NUMPY_TYPES.get_or_try_init(py, || {
        let np = py.import("numpy")?;
        let get = |n: &str| -> PyResult<Py<PyType>> {
            Ok(np.getattr(n)?.cast_into::<PyType>()?.unbind())
        };
        Ok::<_, PyErr>([
            get("integer")?,
            get("floating")?,
            get("bool_")?,
            get("generic")?,
        ])
    })?;
    Ok([t[0].bind(py), t[1].bind(py), t[2].bind(py), t[3].bind(py)])
}

/// The two errors of an argument: the one for a value of another type, the one for a value
/// out of range.
#[derive(Clone, Copy)]
pub(super) struct Errors<'a, 'py> {
    pub(super) wrong_type: &'a Bound<'py, PyType>,
    pub(super) out_of_range: &'a Bound<'py, PyType>,
}

/// The engine's: `ArgumentTypeError` and `InvalidTransferError`.
pub(super) fn engine_errors(py: Python<'_>) -> PyResult<(Bound<'_, PyType>, Bound<'_, PyType>)> {
    Ok((
        argument_type_error(py)?.clone(),
        py.get_type::<InvalidTransferError>(),
    ))
}

fn raise(ty: &Bound<'_, PyType>, msg: String) -> PyErr {
    PyErr::from_type(ty.clone(), msg)
}

/// A wrong-typed argument of the engine's, worded as every other.
pub(super) fn wrong_type(py: Python<'_>, msg: String) -> PyErr {
    match argument_type_error(py) {
        Ok(t) => raise(t, msg),
        Err(e) => e,
    }
}

/// A refused value as a message shows it: its repr where that is plain (`0`, `2.0`, `True`,
/// `np.int64(-1)`, a short string such as `'8'`), else its type (`a Tensor`).
pub(super) fn shown(value: &Bound<'_, PyAny>) -> String {
    let plain = value.is_none()
        || value.is_instance_of::<PyInt>()
        || value.is_instance_of::<PyFloat>()
        || value.is_instance_of::<pyo3::types::PyComplex>()
        || numpy_types(value.py()).is_ok_and(|t| value.is_instance(t[3]).unwrap_or(false))
        || (value.is_instance_of::<PyString>() || value.is_instance_of::<PyBytes>())
            && value.len().is_ok_and(|n| n <= 40);
    if plain {
        if let Ok(r) = value.repr() {
            return r.to_string();
        }
    }
    let name = value
        .get_type()
        .name()
        .map_or_else(|_| "object".to_owned(), |n| n.to_string());
    format!("a {name}")
}

/// `n`, where it is a power of two from 2**31 up (or one less, or its negative) as one:
/// `2**64 - 1`, `-2**127`.
fn bound(n: i128) -> String {
    for (k, rest) in [(n, ""), (n.saturating_add(1), " - 1")] {
        let a = k.unsigned_abs();
        if a >= 1 << 31 && a.is_power_of_two() {
            let sign = if k < 0 { "-" } else { "" };
            return format!("{sign}2**{}{rest}", a.trailing_zeros());
        }
    }
    n.to_string()
}

fn range_text(lo: Option<i128>, hi: Option<i128>) -> String {
    match (lo, hi) {
        (Some(lo), Some(hi)) => format!(" from {} to {}", bound(lo), bound(hi)),
        (Some(lo), None) => format!(" >= {}", bound(lo)),
        (None, Some(hi)) => format!(" <= {}", bound(hi)),
        (None, None) => String::new(),
    }
}

/// Whether `value` is an int as an argument takes one: Python's, or numpy's where `numpy`; a
/// bool is not.
fn is_int(value: &Bound<'_, PyAny>, numpy: bool) -> PyResult<bool> {
    if value.is_instance_of::<PyBool>() {
        return Ok(false);
    }
    if value.is_instance_of::<PyInt>() {
        return Ok(true);
    }
    Ok(numpy && value.is_instance(numpy_types(value.py())?[0])?)
}

/// What [`check_int`] checks: the bounds, whether None passes, the int's name in messages.
#[derive(Clone, Copy)]
pub(super) struct IntArg<'a> {
    pub(super) lo: Option<i128>,
    pub(super) hi: Option<i128>,
    pub(super) optional: bool,
    pub(super) numpy: bool,
    pub(super) what: &'a str,
}

impl IntArg<'_> {
    /// An int in `[lo, hi]`.
    pub(super) const fn within(lo: i128, hi: i128) -> Self {
        IntArg {
            lo: Some(lo),
            hi: Some(hi),
            optional: false,
            numpy: true,
            what: "an int",
        }
    }

    pub(super) const fn or_none(self) -> Self {
        IntArg {
            optional: true,
            ..self
        }
    }
}

impl<'a> IntArg<'a> {
    pub(super) const fn named(self, what: &'a str) -> Self {
        IntArg { what, ..self }
    }
}

/// `value` of argument `name` as an int (the Python object, `int(value)`) if it is one within
/// the bounds, None where it is None and `optional`; else `errors.wrong_type` for a value of
/// another type, `errors.out_of_range` for an int out of range.
pub(super) fn check_int<'py>(
    name: &str,
    value: &Bound<'py, PyAny>,
    arg: IntArg<'_>,
    errors: Errors<'_, 'py>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    if value.is_none() && arg.optional {
        return Ok(None);
    }
    if !is_int(value, arg.numpy)? {
        let alt = if arg.optional { " or None" } else { "" };
        return Err(raise(
            errors.wrong_type,
            format!("{name} must be {}{alt}, not {}", arg.what, shown(value)),
        ));
    }
    let n = value.call_method0("__index__")?;
    // Past i128: outside any bound given, on the side of its sign.
    let outside = if let Ok(v) = n.extract::<i128>() {
        arg.lo.is_some_and(|lo| v < lo) || arg.hi.is_some_and(|hi| v > hi)
    } else if n.lt(0)? {
        arg.lo.is_some()
    } else {
        arg.hi.is_some()
    };
    if outside {
        return Err(raise(
            errors.out_of_range,
            format!(
                "{name} must be {}{}, not {}",
                arg.what,
                range_text(arg.lo, arg.hi),
                shown(value)
            ),
        ));
    }
    Ok(Some(n))
}

/// [`check_int`] with the engine's errors, as the Rust type the core takes.
pub(super) fn int<T: TryFrom<i128>>(
    name: &str,
    value: &Bound<'_, PyAny>,
    arg: IntArg<'_>,
) -> PyResult<T> {
    // Python's int in range: no error type looked up.
    if value.is_exact_instance_of::<PyInt>() {
        if let Ok(v) = value.extract::<i128>() {
            if arg.lo.is_none_or(|lo| v >= lo) && arg.hi.is_none_or(|hi| v <= hi) {
                if let Ok(t) = T::try_from(v) {
                    return Ok(t);
                }
            }
        }
    }
    let py = value.py();
    let (wrong, range) = engine_errors(py)?;
    let errors = Errors {
        wrong_type: &wrong,
        out_of_range: &range,
    };
    let n = check_int(name, value, arg, errors)?
        .ok_or_else(|| raise(&range, format!("{name} must be {}, not None", arg.what)))?;
    let v: i128 = n.extract()?;
    T::try_from(v).map_err(|_| {
        raise(
            &range,
            format!("{name} must be {}{}", arg.what, range_text(arg.lo, arg.hi)),
        )
    })
}

/// [`int`] where None passes.
pub(super) fn opt_int<T: TryFrom<i128>>(
    name: &str,
    value: Option<&Bound<'_, PyAny>>,
    arg: IntArg<'_>,
) -> PyResult<Option<T>> {
    match value {
        Some(v) if !v.is_none() => int(name, v, arg.or_none()).map(Some),
        _ => Ok(None),
    }
}

/// `value` of argument `name` if it is a bool (Python's or numpy's; an array or a string is
/// not taken for its truth), else the engine's typed error.
pub(super) fn flag(name: &str, value: &Bound<'_, PyAny>) -> PyResult<bool> {
    if let Ok(b) = value.cast::<PyBool>() {
        return Ok(b.is_true());
    }
    if value.is_instance(numpy_types(value.py())?[2])? {
        return value.is_truthy();
    }
    Err(wrong_type(
        value.py(),
        format!("{name} must be a bool, not {}", shown(value)),
    ))
}

/// The CPU ids of the engine option `cpus`: ints from any iterable but a str (a list, a set, a
/// range, ``os.sched_getaffinity(0)``), or None where it is None; the core checks the set.
pub(super) fn cpu_ids(value: &Bound<'_, PyAny>) -> PyResult<Option<Vec<usize>>> {
    if value.is_none() {
        return Ok(None);
    }
    let not_ids = || {
        wrong_type(
            value.py(),
            format!(
                "cpus must be CPU ids (ints, a list or a set), not {}",
                shown(value)
            ),
        )
    };
    if value.cast::<PyString>().is_ok() {
        return Err(not_ids());
    }
    let limit = crate::affinity::CPU_LIMIT;
    let id = IntArg::within(0, limit as i128 - 1);
    let mut ids = Vec::new();
    for item in value.try_iter().map_err(|_| not_ids())? {
        if ids.len() == 4 * limit {
            // An endless iterator (itertools.repeat) is refused, not followed forever.
            return Err(invalid(format!(
                "cpus names more than {} CPU ids",
                4 * limit
            )));
        }
        ids.push(int("cpus", &item?, id)?);
    }
    Ok(Some(ids))
}

/// The engine option `cpus` checked (see [`crate::affinity`]); where it is left out and the
/// calling thread may run on one CPU only, a warning: the engine's threads would share it.
pub(super) fn cpus_option(py: Python<'_>, given: &Given<'_>) -> PyResult<Option<Cpus>> {
    let ids = given.or(None, cpu_ids)?;
    if let Some(ids) = ids {
        // Tried on a thread of its own, which the caller waits for.
        return py.detach(|| Cpus::new(ids)).map(Some).map_err(invalid);
    }
    if let Some([one]) = crate::affinity::current().as_deref() {
        let msg = format!(
            "this thread may run on CPU {one} only, and the engine's threads, started from it, \
             would share that CPU with it: a transfer would wait for this thread to give the CPU \
             up (milliseconds where it is busy); give the engine's threads other CPUs (the engine \
             option cpus) or this process more (see docs/tuning.md, cpus)"
        );
        user_warning(py, msg)?;
    }
    Ok(None)
}

/// A `UserWarning` with `msg`, pointing at the Python line that called into the core.
/// Warns of the CUDA options a host-backend engine was given and ignores (`Some("name=value")`
/// for each that differs from its default).
pub(super) fn warn_host_ignores<const N: usize>(
    py: Python<'_>,
    options: [Option<String>; N],
) -> PyResult<()> {
    let ignored: Vec<String> = options.into_iter().flatten().collect();
    if ignored.is_empty() {
        return Ok(());
    }
    let s = if ignored.len() > 1 { "s" } else { "" };
    let msg = format!(
        "this engine runs on the host backend, which ignores the CUDA option{s} {}",
        ignored.join(", ")
    );
    user_warning(py, msg)
}

pub(super) fn user_warning(py: Python<'_>, msg: String) -> PyResult<()> {
    let cmsg = std::ffi::CString::new(msg).expect("no NUL in a message the core writes");
    PyErr::warn(
        py,
        &py.get_type::<pyo3::exceptions::PyUserWarning>(),
        &cmsg,
        1,
    )
}

/// `value` of argument `name` if it is a str, else the engine's typed error naming what it
/// must be (`choices`: `"'h2d', 'd2h', 'h2h' or 'd2d'"`, `"a str"`). The core parses the
/// string itself, with its own refusal of one it does not know.
pub(super) fn text(name: &str, value: &Bound<'_, PyAny>, choices: &str) -> PyResult<String> {
    let s = value.cast::<PyString>().map_err(|_| {
        wrong_type(
            value.py(),
            format!("{name} must be {choices}, not {}", shown(value)),
        )
    })?;
    Ok(s.to_cow()?.into_owned())
}

/// A time in seconds as a float (an int past a float's range is infinite), or the engine's
/// typed error naming `name`.
pub(super) fn seconds(name: &str, value: &Bound<'_, PyAny>) -> PyResult<f64> {
    let [integer, floating, numpy_bool, _] = numpy_types(value.py())?;
    let number = !value.is_instance_of::<PyBool>()
        && !value.is_instance(numpy_bool)?
        && (value.is_instance_of::<PyInt>()
            || value.is_instance_of::<PyFloat>()
            || value.is_instance(integer)?
            || value.is_instance(floating)?);
    if !number {
        return Err(wrong_type(
            value.py(),
            format!("{name} must be a number of seconds, not {}", shown(value)),
        ));
    }
    match value.extract::<f64>() {
        Ok(s) => Ok(s),
        Err(e) if e.is_instance_of::<PyOverflowError>(value.py()) => Ok(if value.gt(0)? {
            f64::INFINITY
        } else {
            f64::NEG_INFINITY
        }),
        Err(e) => Err(e),
    }
}

/// A block table's id; anything else names no table.
pub(super) fn table_id(value: &Bound<'_, PyAny>) -> PyResult<u32> {
    if is_int(value, true)? {
        if let Ok(t) = value.extract::<u32>() {
            return Ok(t);
        }
    }
    Err(InvalidTransferError::new_err(format!(
        "no block table {}",
        value.repr()?
    )))
}

/// A job id: an int in `[0, 2**64)`.
pub(super) fn job_id(value: &Bound<'_, PyAny>) -> PyResult<u64> {
    int("job_id", value, IntArg::within(0, U64_MAX))
}

/// `Engine.wait`'s job ids: any iterable of job ids but a `str` or `bytes`.
pub(super) fn job_ids(job_ids: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let iterable = !(job_ids.is_instance_of::<PyString>() || job_ids.is_instance_of::<PyBytes>());
    match job_ids.try_iter() {
        Ok(it) if iterable => it.map(|j| job_id(&j?)).collect(),
        _ => Err(invalid(format!(
            "job_ids must be an iterable of job ids, not {}",
            job_ids.get_type().name()?
        ))),
    }
}

/// Integers as a transfer names them (addresses, sizes, block ids), copied into owned memory.
///
/// The copy is what gets validated and used: the caller's array is not read again once the GIL
/// is released, where another Python thread could write to it between the check and the use (a
/// validated address or block id swapped for one that was never checked). Negative values
/// become huge ones, which validation refuses by name.
pub(super) fn ids(name: &str, value: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    ids_named(|| name.to_owned(), value)
}

/// [`ids`], its name made only where it is needed (a value refused, or converted by numpy).
pub(super) fn ids_named(name: impl Fn() -> String, value: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    // The dtype is looked at first: a failed extraction builds an error, which cost 19 µs a
    // transfer where int64 was tried first on vLLM's int32 ids.
    if let Ok(a) = value.cast::<PyUntypedArray>() {
        if a.ndim() == 1 {
            // The descriptor's fields, read in place: asking numpy whether two dtypes are
            // equivalent runs its casting machinery where they are not the same object (int32
            // ids against int64), 6-9 µs a side on a thread back from a sleep. A strided view
            // (every f-th id of a spec, as the vLLM worker cuts a chunk's sub-blocks) is read
            // through its strides: converted by numpy it cost several µs a side.
            // Only an aligned array whose stride is a whole number of items: rust-numpy reads
            // a view's stride in items (a packed record's 8-byte field 12 bytes apart would
            // read the wrong ids), and an unaligned read is undefined. numpy converts the rest.
            let dt = a.dtype();
            let items = dt.itemsize() as isize;
            if dt.kind() == b'i'
                && dt.is_native_byteorder() != Some(false)
                && a.is_aligned()
                && a.strides().iter().all(|s| s % items == 0)
            {
                match dt.itemsize() {
                    8 => {
                        let a: PyReadonlyArray1<'_, i64> = value.extract()?;
                        return Ok(match a.as_slice() {
                            Ok(s) => s.iter().map(|&v| v as u64).collect(),
                            Err(_) => a.as_array().iter().map(|&v| v as u64).collect(),
                        });
                    }
                    4 => {
                        let a: PyReadonlyArray1<'_, i32> = value.extract()?;
                        let id = |&v: &i32| i64::from(v) as u64;
                        return Ok(match a.as_slice() {
                            Ok(s) => s.iter().map(id).collect(),
                            Err(_) => a.as_array().iter().map(id).collect(),
                        });
                    }
                    _ => {}
                }
            }
        }
    }
    let name = name();
    copy_u64(&name, &int64_array(&name, value)?.extract()?)
}

/// An int64 array's values as the u64 addresses, sizes or ids they carry (see [`ids`]).
pub(super) fn copy_u64(name: &str, a: &PyReadonlyArray1<'_, i64>) -> PyResult<Vec<u64>> {
    // A slice of unaligned int64s is undefined behaviour (numpy makes them: `frombuffer` at an
    // odd offset); [`ids`] copies those into an aligned array before it gets here.
    if !a.is_aligned() {
        return Err(InvalidTransferError::new_err(format!(
            "{name} must be an aligned array (np.array(a, np.int64) copies it)"
        )));
    }
    let s = a
        .as_slice()
        .map_err(|_| InvalidTransferError::new_err(format!("{name} must be a contiguous array")))?;
    Ok(s.iter().map(|&v| v as u64).collect())
}

/// `values` as a contiguous 1-D int64 numpy array: refuses non-integral input (floats, bools,
/// objects other than ints) rather than truncating it, and ints outside int64.
fn int64_array<'py>(name: &str, values: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    let py = values.py();
    let np = py.import("numpy")?;
    let a = np.call_method1("asarray", (values,))?;
    let a = a
        .cast_into::<PyUntypedArray>()
        .map_err(|_| invalid(format!("{name} must be an array")))?;
    let int64 = np.getattr("int64")?;
    if a.len() == 0 {
        return np.call_method1("zeros", (0, int64));
    }
    if a.ndim() != 1 {
        return Err(invalid(format!(
            "{name} must be one-dimensional, not of shape {}",
            a.getattr("shape")?.repr()?
        )));
    }
    let dt = a.dtype();
    if dt.is_equiv_to(&numpy::dtype::<Py<PyAny>>(py)) {
        // Python ints (as numpy makes of a list with one past 64 bits, or dtype=object).
        let items = a.call_method0("tolist")?;
        let mut out = Vec::with_capacity(a.len());
        let mut all_ints = true;
        for v in items.try_iter()? {
            let v = v?;
            if !is_int(&v, true)? {
                all_ints = false;
                break;
            }
            match v.extract::<i64>() {
                Ok(n) => out.push(n),
                Err(_) => {
                    return Err(invalid(format!(
                        "{name} holds {}, outside int64 [-2**63, 2**63)",
                        v.repr()?
                    )))
                }
            }
        }
        if all_ints {
            return Ok(numpy::PyArray1::from_vec(py, out).into_any());
        }
    }
    let kind = dt.kind();
    if kind != b'i' && kind != b'u' {
        return Err(invalid(format!(
            "{name} must hold integers, not {}",
            dt.str()?
        )));
    }
    if kind == b'u' && dt.itemsize() == 8 {
        // Either byte order: `>u8` compares by value as `<u8` does.
        let big = a.call_method1("__gt__", (i64::MAX,))?.call_method0("any")?;
        if big.is_truthy()? {
            return Err(invalid(format!("{name} holds values past 2**63 - 1")));
        }
    }
    let c = np.call_method1("ascontiguousarray", (a, int64))?;
    if c.cast::<PyUntypedArray>()
        .is_ok_and(PyUntypedArrayMethods::is_aligned)
    {
        return Ok(c);
    }
    // An unaligned int64 array (a view at an odd offset of a buffer), which ascontiguousarray
    // returns as it is: copied into numpy's own, aligned, memory.
    np.call_method1("array", (c,))
}

/// The block table ids of an iterable argument, each as [`table_id`] takes it.
pub(super) fn table_ids(value: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    value.try_iter()?.map(|t| table_id(&t?)).collect()
}

/// `blockswap._checks.check_int`: [`check_int`] for the Python layer's own settings, with the
/// two error classes it names (the one for another type, the one for an int out of range).
#[pyfunction]
#[pyo3(name = "check_int")]
#[allow(clippy::too_many_arguments)] // the Python function's arguments, one each
pub(super) fn check_int_py<'py>(
    name: &str,
    value: &Bound<'py, PyAny>,
    lo: Option<i128>,
    hi: Option<i128>,
    optional: bool,
    numpy: bool,
    what: &str,
    wrong_type: &Bound<'py, PyType>,
    out_of_range: &Bound<'py, PyType>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let arg = IntArg {
        lo,
        hi,
        optional,
        numpy,
        what,
    };
    check_int(
        name,
        value,
        arg,
        Errors {
            wrong_type,
            out_of_range,
        },
    )
}

/// `blockswap._checks._shown`: a refused value as [`shown`] words it.
#[pyfunction]
#[pyo3(name = "shown")]
pub(super) fn shown_py(value: &Bound<'_, PyAny>) -> String {
    shown(value)
}

// ---- the engine's arguments ---------------------------------------------------------------

/// The strings each option takes, as its refusal names them (the order of `blockswap._types`).
pub(super) const BACKENDS: &str = "'auto', 'host' or 'cuda'";
pub(super) const DIRECTIONS: &str = "'h2d', 'd2h', 'h2h' or 'd2d'";
pub(super) const KINDS: &str = "'host' or 'device'";
pub(super) const COPY_PATHS: &str = "'auto', 'batch' or 'loop'";
pub(super) const COMPLETIONS: &str = "'auto', 'write_value' or 'event'";
pub(super) const ORDERS: &str = "'any' or 'stream'";
pub(super) const STREAM: &str = "a raw CUstream int";
pub(super) const WAIT_STREAM: &str =
    "a raw CUstream int (e.g. torch.cuda.current_stream().cuda_stream)";

/// The ranges of the core's integer settings: an int outside cannot reach the core's own
/// checks, which word its limits.
pub(super) const I32: IntArg<'static> = IntArg::within(i32::MIN as i128, i32::MAX as i128);
pub(super) const I128: IntArg<'static> = IntArg::within(i128::MIN, i128::MAX);
pub(super) const U64: IntArg<'static> = IntArg::within(0, U64_MAX);

/// An argument as the caller passed it, or `None` where the caller left it out (which is not
/// the same as passing None: `copy_path=None` is refused by name).
pub(super) struct Given<'py>(pub(super) Option<Bound<'py, PyAny>>);

impl<'a, 'py> FromPyObject<'a, 'py> for Given<'py> {
    type Error = PyErr;
    fn extract(ob: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Given(Some(ob.to_owned())))
    }
}

impl<'py> Given<'py> {
    /// The value converted by `f`, or `default` where the argument was left out.
    pub(super) fn or<T>(
        &self,
        default: T,
        f: impl FnOnce(&Bound<'py, PyAny>) -> PyResult<T>,
    ) -> PyResult<T> {
        self.0.as_ref().map_or(Ok(default), f)
    }

    /// `name=<repr>` where the argument was given and `differs` from its default.
    pub(super) fn changed(&self, name: &str, differs: bool) -> Option<String> {
        let v = self.0.as_ref()?;
        differs.then(|| {
            format!(
                "{name}={}",
                v.repr().map_or_else(|_| "?".into(), |r| r.to_string())
            )
        })
    }
}

/// A direction argument: a str the core parses.
pub(super) fn direction_arg(value: &Bound<'_, PyAny>) -> PyResult<Direction> {
    direction(&text("direction", value, DIRECTIONS)?)
}

pub(super) fn kind_arg(value: &Bound<'_, PyAny>) -> PyResult<MemoryKind> {
    let s = text("kind", value, KINDS)?;
    let s = s.as_str();
    MemoryKind::parse(s).ok_or_else(|| invalid(format!("kind must be {KINDS}, not {s:?}")))
}

pub(super) fn launcher_arg(value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Py<PyAny>>> {
    match value {
        Some(l) if !l.is_none() => {
            if !l.is_callable() {
                return Err(wrong_type(
                    l.py(),
                    format!("launcher must be callable or None, not {}", shown(l)),
                ));
            }
            Ok(Some(l.clone().unbind()))
        }
        _ => Ok(None),
    }
}
