//! A transfer of several KV-cache groups (see [`expand_groups_into`]): each group checked and
//! written by its plan, then what the groups write proven apart.

use super::{
    check_written, chunk_blocks, expand_into, expand_runs_into, expand_staged_into, finish_staged,
    stage_cell_group, unique, written_pages, written_rows, BlockTable, Overlap, Pair, Run,
    StagedCursor, StagedExpansion, TableError,
};
use crate::descriptor::{Columns, Prepared, Scratch, Side};
use crate::plan::Plan;

/// How [`expand_groups_into`] writes a transfer into its slab: a descriptor per page, merged
/// where the `bool` (coalesce) says and both addresses continue ([`expand_into`]); one plan of
/// 2-D copies per group ([`expand_runs_into`]); or the staged plan ([`expand_staged_into`]).
pub type Expansion<'a> = Plan<bool, &'a [Vec<Run>], StagedExpansion>;

/// One KV-cache group of a block transfer (see [`expand_groups_into`]): its two tables and ids.
///
/// With `chunks: Some(skip)`, the side whose table counts chunks (registered with `unit` > 1: a
/// CPU block of `unit` GPU-sized sub-blocks) is named by chunk ids, mapped by [`chunk_blocks`]
/// from sub-block `skip` of its first chunk, and the other side's ids give the number of blocks.
/// With `None`, both sides are named by table blocks.
#[derive(Clone, Copy, Debug)]
pub struct Group<'a> {
    pub src: &'a BlockTable,
    pub src_ids: &'a [u64],
    pub dst: &'a BlockTable,
    pub dst_ids: &'a [u64],
    pub chunks: Option<u64>,
}

impl Group<'_> {
    /// The blocks the group moves (before its ids are checked: a bound for sizing a slab).
    #[must_use]
    pub fn blocks(&self) -> usize {
        match self.chunks {
            Some(_) if self.src.unit > 1 => self.dst_ids.len(),
            _ => self.src_ids.len(),
        }
    }
}

/// Checks a transfer of several KV-cache groups and writes their descriptors (`runs: None`, as
/// [`expand_into`]) or 2-D copies (one plan per group, as [`expand_runs_into`]) into `out`, group
/// after group. A group may be empty (no id on either side); the transfer may not. Errors name the
/// group where there are several, and positions in chunk ids where a side has them.
///
/// Destinations are proven disjoint within each group by its plan (see the module's rule);
/// across groups by `apart` (the caller found every two groups' destination tables
/// [`BlockTable::apart_from`] each other) or their tables' spans, or, where two groups'
/// destination tables may share bytes (one tensor in two groups), by checking what the whole
/// batch writes (pages, 2-D copies' rows or staged pages alike).
/// `out` must have room for every group's descriptors; `bufs` holds expanded chunk ids.
pub fn expand_groups_into(
    groups: &[Group<'_>],
    plan: Expansion<'_>,
    out: Columns<'_>,
    scratch: &mut Scratch,
    bufs: &mut [Vec<u64>; 2],
    apart: bool,
) -> Result<Prepared, TableError> {
    let many = groups.len() > 1;
    let in_group = |group: usize, error: TableError| {
        if many {
            TableError::InGroup {
                group,
                error: Box::new(error),
            }
        } else {
            error
        }
    };
    let Columns { src, dst, size } = out;
    let mut total = Prepared {
        len: 0,
        bytes: 0,
        max_size: 0,
        alignment: 16,
        staged_rows: 0,
        staged_blocks_at: 0,
        staged_blocks: 0,
    };
    // The destination tables so far (one entry per geometry), and the ids written there (with
    // several groups): groups that write one table, or tables of one geometry (the handlers
    // register a table per group), whose geometry proves distinct blocks apart are proven apart
    // by their ids, without sorting what they write.
    let mut used: Vec<(&BlockTable, Vec<u64>)> = Vec::new();
    let (mut shared, mut same_table) = (false, false);
    let mut cursor = match plan {
        Plan::Staged(StagedExpansion {
            rows,
            blocks,
            merge,
            ..
        }) => StagedCursor::new(rows, blocks, merge),
        _ => StagedCursor::default(),
    };
    for (gi, g) in groups.iter().enumerate() {
        let [sb, db] = &mut *bufs;
        let (sids, dids, skip) = match (g.chunks, g.src.unit > 1, g.dst.unit > 1) {
            (None, ..) | (Some(0), false, false) => (g.src_ids, g.dst_ids, None),
            (Some(skip), true, false) => {
                chunk_blocks(
                    g.src,
                    Side::Src,
                    g.dst,
                    g.src_ids,
                    g.dst_ids.len(),
                    skip,
                    sb,
                )
                .map_err(|e| in_group(gi, e))?;
                (&sb[..], g.dst_ids, None)
            }
            (Some(skip), false, true) => {
                chunk_blocks(
                    g.dst,
                    Side::Dst,
                    g.src,
                    g.dst_ids,
                    g.src_ids.len(),
                    skip,
                    db,
                )
                .map_err(|e| in_group(gi, e))?;
                (g.src_ids, &db[..], Some(skip))
            }
            (Some(_), true, true) => {
                let e = "both tables count chunks (unit > 1): name one side by block ids";
                return Err(in_group(gi, TableError::BadChunking(e.into())));
            }
            (Some(skip), false, false) => {
                let e = format!(
                    "a skip of {skip} sub-blocks, but neither table counts chunks (unit > 1)"
                );
                return Err(in_group(gi, TableError::BadChunking(e)));
            }
        };
        if sids.is_empty() && dids.is_empty() && many {
            continue;
        }
        // Staged plans place rows and pages themselves (see `StagedCursor`).
        let w = if matches!(plan, Plan::Staged(_)) {
            0
        } else {
            total.len
        };
        let cols = Columns {
            src: &mut src[w..],
            dst: &mut dst[w..],
            size: &mut size[w..],
        };
        let pair = Pair {
            src: g.src,
            src_ids: sids,
            dst: g.dst,
            dst_ids: dids,
        };
        let p = match plan {
            Plan::Pages(coalesce) => expand_into(pair, coalesce, cols, scratch),
            Plan::Runs(r) => expand_runs_into(pair, &r[gi], cols, scratch),
            Plan::Staged(StagedExpansion {
                host_src,
                cells: false,
                ..
            }) => expand_staged_into(pair, host_src, cols, &mut cursor, scratch),
            Plan::Staged(StagedExpansion {
                host_src,
                cells: true,
                ..
            }) => stage_cell_group(pair, host_src, cols, &mut cursor, scratch),
        };
        let p = p.map_err(|e| {
            let e = match (e, skip) {
                // A repeated chunk: its position among the chunk ids.
                (TableError::DuplicateDestination { name, index, id }, Some(skip)) => {
                    let index = ((skip + index as u64) / g.dst.unit) as usize;
                    TableError::DuplicateDestination { name, index, id }
                }
                (e, _) => e,
            };
            in_group(gi, e)
        })?;
        total.len += p.len;
        total.bytes = total.bytes.wrapping_add(p.bytes);
        total.max_size = total.max_size.max(p.max_size);
        total.alignment = total.alignment.min(p.alignment);
        total.staged_rows += p.staged_rows;
        if many && !apart {
            let (lo, hi) = g.dst.span;
            for (t, _) in &used {
                let (a, b) = t.span;
                if lo < b && a < hi {
                    if t.same_pages(g.dst) && g.dst.disjoint {
                        same_table = true;
                    } else {
                        shared = true;
                    }
                }
            }
            match used.iter_mut().find(|(t, _)| t.same_pages(g.dst)) {
                Some((_, ids)) => ids.extend_from_slice(dids),
                None => used.push((g.dst, dids.to_vec())),
            }
        }
    }
    if total.len == 0 {
        return Err(TableError::Empty);
    }
    if let Plan::Staged(expansion) = plan {
        let cols = Columns {
            src: &mut src[..],
            dst: &mut dst[..],
            size: &mut size[..],
        };
        finish_staged(groups, expansion, cols, &mut cursor, scratch, &mut total)?;
    }
    if same_table && !shared {
        // Groups that write one table, each with distinct ids, whose geometry proves distinct
        // blocks apart: apart where no id is written by two of them.
        shared = used.iter().any(|(t, ids)| {
            unique(ids, t.num_blocks, &mut scratch.bits, &mut scratch.pairs).is_err()
        });
    }
    if shared {
        // Two groups' destination tables share memory: no geometry proves the groups' pages
        // apart, so what the whole transfer writes is checked, by the rule each group kept
        // (which names two pages that overlap).
        let table = groups.first().map_or("", |g| g.dst.name.as_str());
        let len = total.len;
        // What the plan wrote where it is not in the slab's columns as written ranges already.
        let ranges = match plan {
            Plan::Runs(_) => Some(written_rows(&src[..len], &dst[..len], &size[..len])),
            // CPU -> GPU: the bytes land in the GPU pages the kernel writes.
            Plan::Staged(StagedExpansion {
                rows,
                host_src,
                direct,
                ..
            }) if host_src || direct => {
                Some(written_pages(src, dst, size, rows..cursor.block, !host_src))
            }
            Plan::Staged(_) | Plan::Pages(_) => None,
        };
        let (addrs, sizes) = match (&ranges, plan) {
            (Some((a, z)), _) => (&a[..], &z[..]),
            // GPU -> CPU: the host rows.
            (None, Plan::Staged(_)) => (&src[..cursor.row], &size[..cursor.row]),
            (None, _) => (&dst[..len], &size[..len]),
        };
        check_written(table, addrs, sizes, Overlap::Groups, scratch)?;
    }
    Ok(total)
}
