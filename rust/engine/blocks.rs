//! Block tables in the engine: registering them, and transfers named by block ids (one
//! KV-cache group or several) written as page descriptors, block plans or staged plans.

use super::{Engine, EngineError, Route, SubmitState};
use crate::backend::BackendError;
use crate::direction::Direction;
use crate::kernel::{KernelSpec, PageKernel};
use crate::plan::Plan;
use crate::region::MemoryKind;
use crate::table::{
    block_route, block_runs, expand_groups_into, staged_cell, staged_cells, staged_fit, staged_row,
    BlockTable, Expansion, Group, Run, StagedExpansion, TableError, TableSpec, PITCHED_ENTRIES,
    STAGED_TABLE_EXTRA,
};
use crate::table::{chunk_skip, STAGED_FULL_STEPS};
use crate::transfer::JobId;

/// Table `id`, checked to describe memory of the kind `needed`.
fn table_of(
    tables: &[Option<BlockTable>],
    id: u32,
    needed: MemoryKind,
) -> Result<&BlockTable, TableError> {
    let t = tables
        .get(id as usize)
        .and_then(Option::as_ref)
        .ok_or(TableError::Unknown(id))?;
    if t.kind != needed {
        return Err(TableError::WrongKind {
            table: id,
            kind: t.kind,
            needed,
        });
    }
    Ok(t)
}

/// The two tables of a block-id transfer, checked against the memory kinds of `direction`.
fn table_pair(
    tables: &[Option<BlockTable>],
    src: u32,
    dst: u32,
    direction: Direction,
) -> Result<(&BlockTable, &BlockTable), TableError> {
    Ok((
        table_of(tables, src, direction.src_kind())?,
        table_of(tables, dst, direction.dst_kind())?,
    ))
}

/// One KV-cache group of [`Engine::submit_groups`]: a source and a destination table by id, with
/// their ids (see [`Group`]: `chunks: Some(skip)` names the side whose table counts chunks by
/// chunk ids).
#[derive(Clone, Copy, Debug)]
pub struct GroupIds<'a> {
    pub src_table: u32,
    pub src_ids: &'a [u64],
    pub dst_table: u32,
    pub dst_ids: &'a [u64],
    pub chunks: Chunks,
}

/// How a group's side of chunks is named (see [`GroupIds`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Chunks {
    /// Both sides by table blocks.
    No,
    /// The side whose table counts `unit` > 1 blocks a chunk by chunk ids, from sub-block `skip`
    /// of the first chunk.
    Skip(u64),
    /// The same, the skip that of the first block's index in its request, where known (vLLM's
    /// `block_indices`): [`crate::table::chunk_skip`] for the chunk side's unit, the blocks of
    /// the other side, a store where the chunks are the destination.
    Index(Option<u64>),
    /// A piece of a connector's spec cut in chunks of `unit` blocks
    /// ([`crate::table::cut_spec`]): with `Some(skip)` as `Skip`, the host table counting
    /// chunks of `unit` blocks; with `None` both sides by table blocks, the host table counting
    /// single ones (a pair per sub-block of a chunk). A host table that counts otherwise is
    /// refused: its chunk ids would name other blocks.
    Spec { unit: u64, skip: Option<u64> },
}

impl Chunks {
    /// The `Group::chunks` of ids `src_ids` in `src` to `dst_ids` in `dst`.
    fn skip(
        self,
        src: &BlockTable,
        src_ids: &[u64],
        dst: &BlockTable,
        dst_ids: &[u64],
    ) -> Option<u64> {
        match self {
            Chunks::No => None,
            Chunks::Skip(skip) => Some(skip),
            Chunks::Spec { skip, .. } => skip,
            Chunks::Index(index) => Some(if src.unit > 1 {
                chunk_skip(src.unit, dst_ids.len() as u64, index, false)
            } else {
                chunk_skip(dst.unit, src_ids.len() as u64, index, true)
            }),
        }
    }
}

impl<'a> GroupIds<'a> {
    /// Both sides named by table blocks.
    #[must_use]
    pub fn blocks(src_table: u32, src_ids: &'a [u64], dst_table: u32, dst_ids: &'a [u64]) -> Self {
        GroupIds {
            src_table,
            src_ids,
            dst_table,
            dst_ids,
            chunks: Chunks::No,
        }
    }
}

/// The groups of a transfer with their tables looked up and checked against `direction`.
fn resolve_groups<'a>(
    tables: &'a [Option<BlockTable>],
    groups: &[GroupIds<'a>],
    direction: Direction,
) -> Result<Vec<Group<'a>>, EngineError> {
    if groups.is_empty() {
        return Err(TableError::Empty.into());
    }
    let many = groups.len() > 1;
    groups
        .iter()
        .enumerate()
        .map(|(gi, g)| {
            match table_pair(tables, g.src_table, g.dst_table, direction)
                .and_then(|pair| spec_units(pair, g.chunks, direction))
            {
                Ok((src, dst)) => Ok(Group {
                    src,
                    src_ids: g.src_ids,
                    dst,
                    dst_ids: g.dst_ids,
                    chunks: g.chunks.skip(src, g.src_ids, dst, g.dst_ids),
                }),
                Err(error) if many => Err(TableError::InGroup {
                    group: gi,
                    error: Box::new(error),
                }
                .into()),
                Err(e) => Err(e.into()),
            }
        })
        .collect()
}

/// `pair` where its host table counts the blocks a spec's piece names it by (see
/// [`Chunks::Spec`]).
fn spec_units<'a>(
    pair: (&'a BlockTable, &'a BlockTable),
    chunks: Chunks,
    direction: Direction,
) -> Result<(&'a BlockTable, &'a BlockTable), TableError> {
    let Chunks::Spec { unit, skip } = chunks else {
        return Ok(pair);
    };
    let host = if direction.src_kind() == MemoryKind::Host {
        pair.0
    } else {
        pair.1
    };
    let want = if skip.is_some() { unit } else { 1 };
    if host.unit == want {
        return Ok(pair);
    }
    Err(TableError::BadChunking(format!(
        "the {} table counts chunks of {} blocks, but the spec names chunks of {unit} blocks \
         (blocks_per_chunk){}",
        if host.name.is_empty() {
            "host"
        } else {
            &host.name
        },
        host.unit,
        if skip.is_some() {
            ""
        } else {
            ", one table pair per sub-block: each host table counts single blocks"
        }
    )))
}

/// A pair of tables with no plan of the kind asked for, `reason` naming why, in its group where
/// there are several.
fn no_plan(group: usize, groups: usize, reason: String) -> EngineError {
    let error = TableError::BadSegment { segment: 0, reason };
    if groups > 1 {
        TableError::InGroup {
            group,
            error: Box::new(error),
        }
        .into()
    } else {
        error.into()
    }
}

impl Engine {
    /// Registers a block table (see [`crate::table`]): one side of a KV cache, checked once
    /// against registered memory. `spec.name` and `spec.unit` only shape error messages (see
    /// [`BlockTable::named`]). Returns its id for [`Engine::submit_blocks`].
    pub fn register_table(&self, spec: TableSpec) -> Result<u32, EngineError> {
        self.check_usable()?;
        let mut state = self.lock();
        let table = spec
            .build(&state.regions)?
            .in_allocations(|a| self.backend.allocation_base(a));
        let id = state
            .tables
            .iter()
            .position(Option::is_none)
            .unwrap_or(state.tables.len());
        if id == state.tables.len() {
            state.tables.push(None);
        }
        // Which registered tables this one's pages never meet (see `SubmitState::apart`): a
        // transfer into two groups' tables then needs no check across them.
        let apart: Vec<(u32, u32)> = state
            .tables
            .iter()
            .enumerate()
            .filter_map(|(j, t)| Some((j, t.as_ref()?)))
            .filter(|(_, t)| t.spans_overlap(&table) && t.apart_from(&table))
            .map(|(j, _)| (j.min(id) as u32, j.max(id) as u32))
            .collect();
        state.apart.extend(apart);
        state.tables[id] = Some(table);
        Ok(id as u32)
    }

    /// Removes a block table. Refused while transfers are in flight.
    pub fn unregister_table(&self, id: u32) -> Result<(), EngineError> {
        let mut state = self.lock_here()?;
        match state.tables.get(id as usize) {
            Some(Some(_)) => {}
            _ => return Err(TableError::Unknown(id).into()),
        }
        let in_flight = self.unfinished();
        if in_flight > 0 {
            return Err(TableError::Busy {
                table: id,
                in_flight: in_flight as usize,
            }
            .into());
        }
        state.tables[id as usize] = None;
        state.apart.retain(|&(a, b)| a != id && b != id);
        Ok(())
    }

    /// Issues the transfer of one group (see [`GroupIds`], most often [`GroupIds::blocks`]):
    /// blocks `src_ids` of table `src_table` to blocks `dst_ids` of `dst_table` (ids as the
    /// caller's int64 values); each id is checked against its table and destinations must be
    /// distinct; descriptors are written straight into the slab.
    pub fn submit_blocks(
        &self,
        job_id: JobId,
        group: GroupIds<'_>,
        direction: Direction,
        wait_stream: Option<u64>,
        kernel: Option<(u64, PageKernel<'_>)>,
    ) -> Result<(), EngineError> {
        self.submit_groups(
            job_id,
            &[group],
            direction,
            wait_stream,
            Plan::Pages(kernel),
        )
    }

    /// Makes a compiled copy kernel launchable by this engine (see [`KernelSpec`]): a page
    /// kernel's id goes in [`PageKernel::Loaded`], a staged kernel's in [`Plan::Staged`].
    /// Parameters of neither kind are refused on every backend; `None` on the host backend,
    /// which copies pages with memcpy.
    pub fn load_kernel(&self, spec: KernelSpec) -> Result<Option<u32>, EngineError> {
        self.check_usable()?;
        spec.kind().map_err(BackendError::InvalidArgument)?;
        Ok(self.backend.load_kernel(spec)?)
    }

    /// Makes the staging resources of `direction` (CPU -> GPU or GPU -> CPU) now, with this
    /// engine's slots ([`Self::stage_bytes`]) where `ring` (a direct transfer's lane needs
    /// none), rather than on its first staged transfer, which otherwise waits for them (see
    /// [`crate::backend::Backend::prepare_staged`]). Nothing on the host backend.
    pub fn prepare_staged(&self, direction: Direction, ring: bool) -> Result<(), EngineError> {
        self.check_usable()?;
        if !direction.crosses() {
            return Err(BackendError::InvalidArgument(format!(
                "the staged plan moves between host and device (h2d or d2h), not {direction}"
            ))
            .into());
        }
        Ok(self
            .backend
            .prepare_staged(direction, self.config.stage_bytes, ring)?)
    }

    /// The bytes of a block's host row where `table` is block-major (see [`staged_row`]): what
    /// the staged plan moves per block, and what must fit a staging slot. `None` otherwise.
    pub fn staged_row(&self, table: u32) -> Result<Option<u64>, EngineError> {
        let state = self.lock_here()?;
        let t = state
            .tables
            .get(table as usize)
            .and_then(Option::as_ref)
            .ok_or(TableError::Unknown(table))?;
        Ok(staged_row(t))
    }

    /// Whether a cache whose KV-cache groups have the host tables `host_tables` takes the staged
    /// plan with this engine's slots (see [`staged_fit`]): `Ok(the largest row)` or `Err(why
    /// not)`. Where blocks leave holes in their cells (the cell plan), the cells their blocks
    /// share (the union of the spans of tables at one stride) must fit a slot too.
    pub fn staged_route(&self, host_tables: &[u32]) -> Result<Result<u64, String>, EngineError> {
        self.cells_route(host_tables, true)
    }

    /// Whether a cache whose KV-cache groups have the host tables `host_tables` takes the direct
    /// plan ([`crate::table::StagedRequest::direct`]): each host table's blocks laid out in
    /// chunks or cells no larger than a slot, as the staged plan needs ([`staged_fit`]), but
    /// the cells need not be whole (holes are another rank's pages, as in vLLM's canonical
    /// layout: no row crosses `PCIe`). `Ok(the largest block span)` or `Err(why not)`.
    pub fn direct_route(&self, host_tables: &[u32]) -> Result<Result<u64, String>, EngineError> {
        self.cells_route(host_tables, false)
    }

    /// [`Self::staged_route`], or without `whole` [`Self::direct_route`].
    fn cells_route(
        &self,
        host_tables: &[u32],
        whole: bool,
    ) -> Result<Result<u64, String>, EngineError> {
        let state = self.lock_here()?;
        let slot = self.config.stage_bytes;
        let mut largest = None;
        let mut tables = Vec::with_capacity(host_tables.len());
        for &id in host_tables {
            let t = table_of(&state.tables, id, MemoryKind::Host)?;
            match staged_fit(t, slot) {
                Ok((row, _)) => largest = largest.max(Some(row)),
                Err(why) => return Ok(Err(why)),
            }
            tables.push(t);
        }
        if !whole {
            return Ok(largest.ok_or_else(|| "no KV-cache group".to_string()));
        }
        match staged_cells(&tables) {
            Err(why) => return Ok(Err(why)),
            Ok(Some(cell)) if cell > slot => {
                return Ok(Err(format!(
                    "a cell's blocks span {cell} bytes, more than a staging slot (stage_bytes = \
                     {slot})"
                )))
            }
            Ok(_) => {}
        }
        Ok(largest.ok_or_else(|| "no KV-cache group".to_string()))
    }

    /// Whether every one of `host_tables` is block-major, each block's pages (two or more) one
    /// chunk inside one registered region, or cell-major, the pages in one cell of the table
    /// with holes the other tables fill ([`staged_cell`], [`staged_cells`]), whoever allocated
    /// the memory: the layout on which the block and staged plans are taken by default (see
    /// [`crate::plan::choice::Ask`]). A block of one page is no row to join: its copies are the
    /// page route's. False for no table.
    pub fn block_major(&self, host_tables: &[u32]) -> Result<bool, EngineError> {
        let state = self.lock_here()?;
        let mut all = !host_tables.is_empty();
        let mut tables = Vec::with_capacity(host_tables.len());
        for &id in host_tables {
            let t = table_of(&state.tables, id, MemoryKind::Host)?;
            all &= t.segments() > 1 && staged_cell(t).is_some();
            tables.push(t);
        }
        Ok(all && staged_cells(&tables).is_ok())
    }

    /// The staging slot size of this engine (see [`super::EngineConfig::stage_bytes`]).
    pub fn stage_bytes(&self) -> u64 {
        self.config.stage_bytes
    }

    /// The block plan of a table pair for `direction` (see [`block_runs`]): the 2-D copies one
    /// block takes with [`Engine::submit_block_runs`]. `None` where the pair has none.
    pub fn block_runs(
        &self,
        src_table: u32,
        dst_table: u32,
        direction: Direction,
    ) -> Result<Option<Vec<Run>>, EngineError> {
        let state = self.lock_here()?;
        let (s, d) = table_pair(&state.tables, src_table, dst_table, direction)?;
        Ok(block_runs(s, d))
    }

    /// Whether a cache whose groups are the table pairs `pairs` (source, destination as
    /// `direction` moves them) takes the block route by default, or with `insist` wherever a
    /// plan saves a copy (see [`block_route`]): `Ok(why)` or `Err(why not)`.
    pub fn block_route(
        &self,
        pairs: &[(u32, u32)],
        direction: Direction,
        insist: bool,
    ) -> Result<Result<String, String>, EngineError> {
        let state = self.lock_here()?;
        let tables = pairs
            .iter()
            .map(|&(s, d)| table_pair(&state.tables, s, d, direction))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(block_route(
            &tables,
            direction == Direction::DeviceToHost,
            insist,
        ))
    }

    /// [`Engine::submit_blocks`], each block moved as the 2-D copies of the pair's block plan
    /// (one per [`Run`]) instead of a descriptor per page: copy engines only. Refused where the
    /// pair has no block plan.
    pub fn submit_block_runs(
        &self,
        job_id: JobId,
        group: GroupIds<'_>,
        direction: Direction,
        wait_stream: Option<u64>,
    ) -> Result<(), EngineError> {
        self.submit_groups(job_id, &[group], direction, wait_stream, Plan::Runs(()))
    }

    /// Issues one transfer of several KV-cache groups, each a pair of tables with its ids (see
    /// [`GroupIds`]; a side may be named by chunk ids), as one batch with one completion:
    /// descriptors per page (`Plan::Pages`, optionally with the small ones to a kernel), the 2-D
    /// copies of each pair's block plan (`Plan::Runs`, refused where a pair has none) or the
    /// staged plan (`Plan::Staged`, refused where a host table is not block-major). Ids,
    /// chunk counts and destinations are checked as [`expand_groups_into`] documents.
    pub fn submit_groups(
        &self,
        job_id: JobId,
        groups: &[GroupIds<'_>],
        direction: Direction,
        wait_stream: Option<u64>,
        route: Route<'_>,
    ) -> Result<(), EngineError> {
        let (coalesce, slot) = (self.config.coalesce, self.config.stage_bytes);
        let shape = route.map(|_| (), |()| (), |s| s.direct);
        self.submit_with(
            job_id,
            |state| {
                let resolved = resolve_groups(&state.tables, groups, direction)?;
                group_sizing(&resolved, shape, direction, slot)
            },
            direction,
            wait_stream,
            route,
            |state, cols, sizing| {
                let SubmitState {
                    tables,
                    apart,
                    scratch,
                    chunk_ids,
                    ..
                } = state;
                let resolved = resolve_groups(tables, groups, direction)?;
                let plan = expansion(&sizing, coalesce, slot, direction);
                let apart = groups_apart(groups, &resolved, apart);
                expand_groups_into(&resolved, plan, cols, scratch, chunk_ids, apart)
                    .map_err(EngineError::from)
            },
        )
    }
}

/// Whether every two groups' destination tables (`resolved`, in the order of `groups`) are
/// distinct and never share a byte: their spans apart, or registered as apart
/// (`SubmitState::apart`); false for one group (nothing to prove) as for any pair that is not.
fn groups_apart(
    groups: &[GroupIds<'_>],
    resolved: &[Group<'_>],
    apart: &std::collections::HashSet<(u32, u32)>,
) -> bool {
    let pair_apart = |i: usize, j: usize| {
        let (a, b) = (groups[i].dst_table, groups[j].dst_table);
        a != b
            && (!resolved[i].dst.spans_overlap(resolved[j].dst)
                || apart.contains(&(a.min(b), a.max(b))))
    };
    groups.len() > 1 && (0..groups.len()).all(|i| (i + 1..groups.len()).all(|j| pair_apart(i, j)))
}

/// What sizing a group transfer's slab found out for its fill: nothing more for pages, each
/// group's block plan, the staged plan's rows and host bytes.
type Sizing = Plan<(), Vec<Vec<Run>>, StagedSize>;

#[derive(Clone, Copy, Debug)]
struct StagedSize {
    rows: usize,
    blocks: usize,
    bytes: u64,
    cells: bool,
    direct: bool,
}

/// The host side of a group of a transfer between host and device.
fn host_of<'a>(g: &Group<'a>, host_src: bool) -> &'a BlockTable {
    if host_src {
        g.src
    } else {
        g.dst
    }
}

/// The slab entries of a group transfer on `shape`'s route, and what the fill needs from that
/// count; refused where a group has no plan of that route.
fn group_sizing(
    resolved: &[Group<'_>],
    shape: Plan<(), (), bool>,
    direction: Direction,
    slot: u64,
) -> Result<(usize, Sizing), EngineError> {
    let n = resolved.len();
    match shape {
        // A descriptor per (segment, block) pair before coalescing.
        Plan::Pages(()) => Ok((
            resolved.iter().fold(0usize, |n, g| {
                n.saturating_add(g.src.segments().saturating_mul(g.blocks()))
            }),
            Plan::Pages(()),
        )),
        Plan::Runs(()) => {
            let mut entries = 0usize;
            let mut runs = Vec::with_capacity(n);
            for (gi, g) in resolved.iter().enumerate() {
                let r = block_runs(g.src, g.dst).ok_or_else(|| {
                    no_plan(
                        gi,
                        n,
                        "these tables have no block plan (their pages differ in size): move \
                         them page by page"
                            .into(),
                    )
                })?;
                entries =
                    entries.saturating_add((PITCHED_ENTRIES * r.len()).saturating_mul(g.blocks()));
                runs.push(r);
            }
            Ok((entries, Plan::Runs(runs)))
        }
        Plan::Staged(direct) => {
            if !direction.crosses() {
                let why =
                    format!("these tables have no staged plan: {direction} moves no host row");
                return Err(no_plan(0, 1, why));
            }
            let host_src = direction == Direction::HostToDevice;
            // Rows, block entries and geometries (see `crate::table::staged`): a row per block,
            // or with the cell plan (a host table's blocks leave holes in their cells) one per
            // page; a block entry per block; a geometry per group (a hole at most between two
            // segments).
            let (mut page_rows, mut blocks, mut tables) = (0usize, 0usize, 0usize);
            let (mut bytes, mut cells) = (0u64, false);
            for (gi, g) in resolved.iter().enumerate() {
                let (row, holes) = staged_fit(host_of(g, host_src), slot).map_err(|why| {
                    no_plan(gi, n, format!("these tables have no staged plan: {why}"))
                })?;
                cells |= holes;
                bytes = bytes.saturating_add(row.saturating_mul(g.blocks() as u64));
                let segments = g.src.segments();
                page_rows = page_rows.saturating_add(g.blocks().saturating_mul(segments));
                blocks = blocks.saturating_add(g.blocks());
                tables = tables.saturating_add(2 * segments + STAGED_TABLE_EXTRA);
            }
            // Direct: no row at all, the cell plan's entries whatever the holes.
            cells |= direct;
            let rows = match (direct, cells) {
                (true, _) => 0,
                (false, true) => page_rows,
                (false, false) => blocks,
            };
            let entries = rows.saturating_add(blocks).saturating_add(tables);
            Ok((
                entries,
                Plan::Staged(StagedSize {
                    rows,
                    blocks,
                    bytes,
                    cells,
                    direct,
                }),
            ))
        }
    }
}

/// The expansion a group transfer's fill writes, from its sizing.
fn expansion(sizing: &Sizing, coalesce: bool, slot: u64, direction: Direction) -> Expansion<'_> {
    match sizing {
        Plan::Pages(()) => Plan::Pages(coalesce),
        Plan::Runs(runs) => Plan::Runs(&runs[..]),
        Plan::Staged(size) => {
            // Rows of blocks that follow each other on the host cross PCIe as one copy (the
            // copy engines pay per copy: 4 KiB pages' rows of 320 KiB reached 82-93 % of the
            // link one copy each, one copy of the same bytes 94-98 %), up to a slot, and to a
            // quarter of the transfer, which keeps its steps.
            let merge = if coalesce {
                slot.min(size.bytes / STAGED_FULL_STEPS as u64)
            } else {
                0
            };
            Plan::Staged(StagedExpansion {
                rows: size.rows,
                blocks: size.blocks,
                host_src: direction == Direction::HostToDevice,
                merge,
                cells: size.cells,
                slot,
                direct: size.direct,
            })
        }
    }
}
