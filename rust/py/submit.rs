//! The submission bindings' shared parts: a `groups` argument read into the core's groups, and
//! the end every group submission takes (the route checked, the engine called with the GIL
//! released).

use pyo3::prelude::*;

use super::args::{self, direction_arg, Given, U64, WAIT_STREAM};
use super::invalid;
use super::route::{launch_with, PyRoute};
use crate::direction::Direction;
use crate::engine::{Chunks, Engine, GroupIds};
use crate::kernel::{KernelBatch, KernelLauncher};
use crate::plan::Plan;
use crate::region::MemoryKind;

/// A group's `(source table, destination table, skip)`.
pub(super) type Tables = Vec<(u32, u32, Option<u64>)>;
/// A group's source and destination ids, copied out of the caller's arrays.
pub(super) type Ids = Vec<(Vec<u64>, Vec<u64>)>;

/// :meth:`Engine.submit_groups`'s ``groups`` (one ``(src_table, src_ids, dst_table, dst_ids,
/// skip)`` per group) read and checked: the tables and skips, and the ids.
pub(super) fn groups(groups: &Bound<'_, PyAny>, dir: Direction) -> PyResult<(Tables, Ids)> {
    let groups = groups.try_iter()?.collect::<PyResult<Vec<_>>>()?;
    // Ids refused before their tables are looked up are named as the tables name theirs.
    let side = |kind: MemoryKind, g: usize| {
        let where_ = if groups.len() > 1 {
            format!("group {g}: ")
        } else {
            String::new()
        };
        format!("{where_}{}", ids_name(kind))
    };
    let mut tables = Vec::new();
    let mut ids = Vec::new();
    for (g, group) in groups.iter().enumerate() {
        let shape = || {
            invalid(format!(
                "groups[{g}] must be (src_table, src_ids, dst_table, dst_ids, skip)"
            ))
        };
        let t = group.cast::<pyo3::types::PyTuple>().map_err(|_| shape())?;
        if t.len() != 5 {
            return Err(shape());
        }
        let skip = t.get_item(4)?;
        // The names are formatted only for a value refused: not on every submission.
        let skip: Option<u64> = match skip.extract::<Option<u64>>() {
            Ok(v) if !skip.is_instance_of::<pyo3::types::PyBool>() => v,
            _ => args::opt_int(&format!("groups[{g}] skip"), Some(&skip), U64)?,
        };
        tables.push((
            args::table_id(&t.get_item(0)?)?,
            args::table_id(&t.get_item(2)?)?,
            skip,
        ));
        ids.push((
            args::ids_named(|| side(dir.src_kind(), g), &t.get_item(1)?)?,
            args::ids_named(|| side(dir.dst_kind(), g), &t.get_item(3)?)?,
        ));
    }
    Ok((tables, ids))
}

/// What refusals call the ids of a side in `kind` memory (as the tables name their blocks).
pub(super) fn ids_name(kind: MemoryKind) -> &'static str {
    match kind {
        MemoryKind::Host => "CPU block ids",
        MemoryKind::Device => "GPU block ids",
    }
}

/// The core's groups over `tables` and `ids` (see [`groups`]).
pub(super) fn group_ids<'a>(tables: &[(u32, u32, Option<u64>)], ids: &'a Ids) -> Vec<GroupIds<'a>> {
    with_chunks(tables, ids, |skip| skip.map_or(Chunks::No, Chunks::Skip))
}

/// The pieces of a spec cut in chunks of `unit` blocks ([`spec_groups`]) as groups, each host
/// table checked against `unit` (see [`Chunks::Spec`]).
pub(super) fn spec_group_ids<'a>(
    tables: &[(u32, u32, Option<u64>)],
    ids: &'a Ids,
    unit: u64,
) -> Vec<GroupIds<'a>> {
    with_chunks(tables, ids, |skip| Chunks::Spec { unit, skip })
}

fn with_chunks<'a>(
    tables: &[(u32, u32, Option<u64>)],
    ids: &'a Ids,
    chunks: impl Fn(Option<u64>) -> Chunks,
) -> Vec<GroupIds<'a>> {
    tables
        .iter()
        .zip(ids)
        .map(|(&(src_table, dst_table, skip), (s, d))| GroupIds {
            src_table,
            src_ids: s,
            dst_table,
            dst_ids: d,
            chunks: chunks(skip),
        })
        .collect()
}

/// The common end of :meth:`submit_groups` and :meth:`submit_group`: `route` checked, the
/// groups handed to the engine with the GIL released.
pub(super) fn issue_groups(
    engine: &Engine,
    py: Python<'_>,
    job_id: u64,
    gs: &[GroupIds<'_>],
    dir: Direction,
    wait_stream: Option<u64>,
    route: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let route = match route {
        Some(r) if !r.is_none() => Some(r.cast::<PyRoute>().map_err(|_| {
            args::wrong_type(
                py,
                format!(
                    "route must be a blockswap.Route or None, not {}",
                    args::shown(r)
                ),
            )
        })?),
        _ => None,
    };
    let route = route.map(Bound::get);
    py.detach(|| {
        let launch = |b: KernelBatch| launch_with(route.expect("a launcher's route"), b);
        let core = route.map_or(Plan::Pages(None), |r| r.core(&launch as KernelLauncher<'_>));
        engine.submit_groups(job_id, gs, dir, wait_stream, core)
    })
    .map_err(Into::into)
}

/// A submission's direction, stream to wait for and kernel bound, checked in that order.
pub(super) fn submission(
    direction: &Given<'_>,
    wait_stream: Option<&Bound<'_, PyAny>>,
    kernel_below: &Given<'_>,
) -> PyResult<(Direction, Option<u64>, u64)> {
    let dir = direction.or(Direction::HostToDevice, direction_arg)?;
    let wait_stream = args::opt_int("wait_stream", wait_stream, U64.named(WAIT_STREAM))?;
    let kernel_below = kernel_below.or(0, |v| args::int("kernel_below", v, U64))?;
    Ok((dir, wait_stream, kernel_below))
}

/// :meth:`Engine.submit_spec`'s groups: the spec's ids read once and cut by
/// [`crate::table::cut_spec`], each piece on its table pair, sources and destinations in
/// `dir`'s order.
pub(super) fn spec_groups(
    gpu_ids: &Bound<'_, PyAny>,
    cpu_ids: &Bound<'_, PyAny>,
    sizes: &Bound<'_, PyAny>,
    starts: &Bound<'_, PyAny>,
    tables: &Bound<'_, PyAny>,
    unit: u64,
    dir: Direction,
) -> PyResult<(Tables, Ids)> {
    let gpu = args::ids_named(|| ids_name(MemoryKind::Device).to_owned(), gpu_ids)?;
    let cpu = args::ids_named(|| ids_name(MemoryKind::Host).to_owned(), cpu_ids)?;
    let counts = |name: &str, v: &Bound<'_, PyAny>| {
        v.extract::<Vec<u64>>()
            .map_err(|_| invalid(format!("{name} must be a sequence of ints >= 0")))
    };
    let (sizes, starts) = (
        counts("group_sizes", sizes)?,
        counts("block_indices", starts)?,
    );
    let pairs: Vec<Vec<(u32, u32)>> = tables.extract().map_err(|_| {
        invalid("tables must hold, per group, a sequence of (src_table, dst_table) pairs")
    })?;
    let npairs: Vec<usize> = pairs.iter().map(Vec::len).collect();
    let pieces = crate::table::cut_spec(&gpu, &cpu, &sizes, &starts, &npairs, unit)
        .map_err(|e| invalid(e.to_string()))?;
    let gpu_src = dir.src_kind() == MemoryKind::Device;
    let mut t = Vec::with_capacity(pieces.len());
    let mut ids = Vec::with_capacity(pieces.len());
    for p in pieces {
        let (src, dst) = pairs[p.group][p.pair];
        t.push((src, dst, p.skip));
        ids.push(if gpu_src {
            (p.gpu, p.cpu)
        } else {
            (p.cpu, p.gpu)
        });
    }
    Ok((t, ids))
}
