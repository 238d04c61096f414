//! The staged plan's slab: host rows that cross `PCIe`, and the blocks whose pages a kernel
//! scatters out of (or gathers into) a device staging ring, each named by its block id and the
//! geometry of its table, so that no page has a descriptor of its own.
//!
//! A transfer of `rows` blocks in all lays out its slab as
//!
//! - `[0, rows)`: host rows `(row address, ring offset, bytes)`, rows of blocks that follow each
//!   other on the host joined (the room past the last row used stays empty);
//! - `[rows, rows + blocks)`: one entry per block `(GPU block id, ring offset of its row, table
//!   at)`;
//! - after them, one geometry per group (groups with equal geometries share one), at `table at`:
//!   a header `(segments, tile, bytes of a block's pages)`, then per segment `s` `(GPU base, GPU
//!   stride, offset of the page in the row)`, then `(0, 0, row bytes)`, so that page `s` is
//!   `offsets[s + 1] - offsets[s]` bytes. A segment of GPU base 0 is a hole: bytes of the row no
//!   page of the block owns, moved by no one (not counted in the header's bytes). `tile`, the
//!   cell plan's only: where every page is as large as the first and lies one gap after the
//!   one before, that gap (a cell's sub-blocks of a tensor side by side), else 0.
//!
//! A host table whose block's pages lie in one cell of the table with holes between them
//! ([`staged_cell`]: vLLM's offload region, where a chunk's cell holds each tensor's pages of
//! several blocks side by side) takes the cell plan ([`stage_cell_group`], [`finish_cells`]):
//! blocks whose spans overlap (the blocks of one cell) form a cluster, laid in the ring as it lies
//! on the host, and the rows are exactly the bytes the cluster's pages cover, joined where they
//! touch, so that a store writes no byte of a sub-block it does not own while a whole cell
//! crosses `PCIe` as one copy. Steps never cut a cluster ([`staged_steps`]).
//!
//! Page `s` of a block is `GPU base[s] + id * GPU stride[s]` on the GPU and `ring offset +
//! offset[s]` in the ring: [`staged_pages`] walks them (the host backend, the tests), and the
//! CUDA backend's kernel computes them the same way. The slab for 32 blocks of 80 layers' K and
//! V pages holds 32 + 32 + 163 entries, not a descriptor per page (5,152): the submitting thread
//! writes a few hundred words, and the kernel's descriptors cross `PCIe` as a few KiB.

use std::ops::Range;

use super::{check_ids, check_written, BlockTable, Group, Overlap, Pair, TableError};
use crate::descriptor::{Columns, Prepared, Scratch};

mod cells;
pub use cells::{finish_cells, stage_cell_group};

/// Slab entries of one group's geometry beyond its segments: the header and the row's end.
pub const STAGED_TABLE_EXTRA: usize = 2;

/// The bytes of one block's row in a block-major table (every segment of a block, in table
/// order, in one contiguous chunk at the block's stride), where the whole row of every block lies
/// in one registered region: what the staged plan moves across `PCIe` as one copy per block. `None`
/// for any other layout.
#[must_use]
pub fn staged_row(t: &BlockTable) -> Option<u64> {
    staged_cell(t).and_then(|(span, holes)| (!holes).then_some(span))
}

/// A block's span in a table the staged plan can take, and whether its pages leave holes in it:
/// every segment at one stride, the pages of a block in table order without sharing a byte, the
/// span inside one registered region; with holes, the span no longer than the stride (a block's
/// pages lie in one cell of the table, as vLLM's offload region lays out a chunk's sub-blocks).
/// `None` for any other layout.
#[must_use]
pub fn staged_cell(t: &BlockTable) -> Option<(u64, bool)> {
    let stride = t.strides[0];
    let mut end = t.bases[0];
    let mut holes = false;
    for s in 0..t.segments() {
        if t.bases[s] < end || t.strides[s] != stride {
            return None;
        }
        holes |= t.bases[s] != end;
        end = t.bases[s].checked_add(t.nbytes[s])?;
    }
    let span = end - t.bases[0];
    (t.disjoint && (!holes || span <= stride) && t.run_in_one_region(0, t.segments() - 1))
        .then_some((span, holes))
}

/// A host table's row where the staged plan can take it with slots of `slot` bytes: the table
/// block-major or cell-major ([`staged_cell`]) and a block's span no larger than a slot, as
/// `(span, holes)`. Why not otherwise, as every refusal of the plan (a submission, the handler's
/// choice of route) words it.
pub fn staged_fit(host: &BlockTable, slot: u64) -> Result<(u64, bool), String> {
    match staged_cell(host) {
        None => Err(
            "the host table is not block-major (a block's pages in one chunk inside one \
                     registered region)"
                .into(),
        ),
        Some((row, _)) if row > slot => Err(format!(
            "a block's row is {row} bytes, more than a staging slot (stage_bytes = {slot})"
        )),
        Some(fit) => Ok(fit),
    }
}

/// Where a cache's host tables leave holes in their cells (see [`staged_cell`]): the bytes the
/// cells hold for the cache, per stride, as the tables together cover them. `Ok(the largest
/// cell's bytes)` (`None` without holes) where the tables of each stride tile their cells (the
/// sub-blocks of a chunk of vLLM's offload region fill each other's holes, so a whole chunk
/// crosses `PCIe` as one row), `Err(why not)` where bytes of a cell are no table's (another
/// rank's pages, padding): those would leave a row per page, the page route's work.
pub fn staged_cells(tables: &[&BlockTable]) -> Result<Option<u64>, String> {
    let mut strides: Vec<u64> = tables
        .iter()
        .filter(|t| staged_cell(t).is_some_and(|(_, holes)| holes))
        .map(|t| t.strides[0])
        .collect();
    strides.sort_unstable();
    strides.dedup();
    let mut largest = None;
    for stride in strides {
        let at = tables.iter().filter(|t| t.strides[0] == stride);
        let lo = at.clone().map(|t| t.bases[0]).min().unwrap_or(0);
        let mut pages: Vec<(u64, u64)> = at
            .flat_map(|t| (0..t.segments()).map(|s| (t.bases[s] - lo, t.nbytes[s])))
            .collect();
        pages.sort_unstable();
        let mut end = 0;
        for (offset, bytes) in pages {
            if offset > end {
                return Err(format!(
                    "bytes {end}..{offset} of a cell of the host tables are no KV-cache \
                     tensor's (another rank's pages or padding)"
                ));
            }
            end = end.max(offset + bytes);
        }
        largest = largest.max(Some(end));
    }
    Ok(largest)
}

/// The staged plan's expansion of a transfer: room for `rows` host rows and `blocks` block
/// entries, the host side the source (`host_src`, CPU -> GPU) or the destination; rows of blocks
/// that follow each other on the host joined up to `merge` bytes (0: never). `cells`: the cell
/// plan (a host table's blocks leave holes in their cells, see [`staged_cell`]), whose
/// clusters fit slots of `slot` bytes. `direct`: the kernel reads or writes the host pages in
/// place (see [`StagedRequest::direct`]): the cell plan's block entries and geometries, no rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagedExpansion {
    pub rows: usize,
    pub blocks: usize,
    pub host_src: bool,
    pub merge: u64,
    pub cells: bool,
    pub slot: u64,
    pub direct: bool,
}

/// Where [`expand_staged_into`] writes next: rows from `row` (room for `rows` of them), blocks
/// from `block` (room for `blocks` from `rows` on), geometries from `table`, ring offsets from
/// `ring`. `merge`: the most bytes one row may grow to by joining the next block's row where it
/// continues on the host (0: never).
#[derive(Clone, Copy, Debug, Default)]
pub struct StagedCursor {
    pub rows: usize,
    pub blocks: usize,
    pub row: usize,
    pub block: usize,
    pub table: usize,
    pub ring: u64,
    pub merge: u64,
}

impl StagedCursor {
    /// A cursor at the start of a slab with room for `rows` rows and `blocks` block entries.
    #[must_use]
    pub fn new(rows: usize, blocks: usize, merge: u64) -> Self {
        StagedCursor {
            rows,
            blocks,
            row: 0,
            block: rows,
            table: rows + blocks,
            ring: 0,
            merge,
        }
    }
}

/// A pair's host side first: `(host table, its ids, GPU table, its ids)`.
fn host_first(pair: Pair<'_>, host_src: bool) -> (&BlockTable, &[u64], &BlockTable, &[u64]) {
    let Pair {
        src,
        src_ids,
        dst,
        dst_ids,
    } = pair;
    if host_src {
        (src, src_ids, dst, dst_ids)
    } else {
        (dst, dst_ids, src, src_ids)
    }
}

/// Reverses, in place, each run of `(host id, GPU id)` pairs whose host ids count down one by one
/// (`9, 8, 7`), so that every such run counts up.
fn reverse_descents(pairs: &mut [(u64, u64)]) {
    let mut i = 0;
    while i < pairs.len() {
        let mut j = i;
        while j + 1 < pairs.len() && pairs[j].0.checked_sub(1) == Some(pairs[j + 1].0) {
            j += 1;
        }
        pairs[i..=j].reverse();
        i = j + 1;
    }
}

/// Checks block ids as [`super::expand_into`] does and writes the staged plan of one group at
/// `cursor` (see the module's layout): its host rows, joined where they continue on the host,
/// do not cross a cut and stay within `cursor.merge`; a block entry per block pair; the group's
/// geometry. Ring offsets count from the transfer's first row (`cursor.ring`, advanced by each
/// row): a backend places a step of whole rows at a slot and adds `slot - first offset of the
/// step` to the ring side (see [`StagedRequest`]).
///
/// The host side must have a [`staged_row`]. A page's bytes in the ring are its bytes in the
/// host row, so the pages [`staged_pages`] names write exactly the bytes
/// [`super::expand_into`]'s descriptors would, and they are held to the same rule: GPU -> CPU,
/// the host rows are disjoint by the host table; CPU -> GPU, the GPU pages are disjoint where the
/// GPU table is, and checked where it is not (its segments may share bytes).
pub fn expand_staged_into(
    pair: Pair<'_>,
    host_src: bool,
    out: Columns<'_>,
    cursor: &mut StagedCursor,
    scratch: &mut Scratch,
) -> Result<Prepared, TableError> {
    check_ids(pair, scratch)?;
    let (host, host_ids, gpu, gpu_ids) = host_first(pair, host_src);
    let row = staged_row(host).ok_or_else(|| {
        TableError::BadChunking(
            "the staged plan needs a block-major host table (a block's pages in one chunk)".into(),
        )
    })?;
    let segments = host.segments();
    let n = host_ids.len();
    let table = cursor.table;
    assert!(
        cursor.row + n <= cursor.rows
            && cursor.block + n <= cursor.rows + cursor.blocks
            && table + segments + STAGED_TABLE_EXTRA <= out.src.len(),
        "slab too small"
    );
    let mut bitmask = row;
    let mut max_size = 0u64;
    out.src[table] = segments as u64;
    // A block-major row is its pages, no hole between them.
    (out.dst[table], out.size[table]) = (0, row);
    for s in 0..segments {
        let offset = host.bases[s] - host.bases[0];
        bitmask |= gpu.bases[s] | gpu.strides[s] | host.nbytes[s] | offset;
        max_size = max_size.max(host.nbytes[s]);
        let at = table + 1 + s;
        (out.src[at], out.dst[at], out.size[at]) = (gpu.bases[s], gpu.strides[s], offset);
    }
    let end = table + 1 + segments;
    (out.src[end], out.dst[end], out.size[end]) = (0, 0, row);
    cursor.table = end + 1;
    let first_row = cursor.row;
    let mut r = first_row;
    // Where rows may join, ids that count down one by one (vLLM's CPU manager hands a request
    // the chunks one eviction freed last freed first) are taken in host order, so their rows
    // cross PCIe as one copy as those of ids counting up do. Each block entry carries its own
    // ring offset, so the order changes which rows go together, never where a byte goes. In
    // one pass: sorting the ids would join any adjacent ones, but costs 28 µs at 2,560 ids.
    let mut order = std::mem::take(&mut scratch.pairs);
    order.clear();
    order.extend(host_ids.iter().copied().zip(gpu_ids.iter().copied()));
    if cursor.merge > 0 {
        reverse_descents(&mut order);
    }
    for &(hi, gi) in &order {
        // In range by `check_ids`; the spans were proven not to overflow at registration.
        let at = cursor.ring;
        let addr = host.bases[0] + hi * host.strides[0];
        // The previous row of this group grows by this one where it continues on the host (the
        // ring side always does: rows lie in the ring one after the other), the two lie on
        // one side of every cut (a new region or piece starts at none between them), and the
        // joined row stays within `merge`: one copy across PCIe instead of two.
        let joins = r > first_row && {
            let last = r - 1;
            out.src[last] + out.size[last] == addr
                && out.size[last] + row <= cursor.merge
                && !host.cut_at(addr)
        };
        if joins {
            out.size[r - 1] += row;
        } else {
            (out.src[r], out.dst[r], out.size[r]) = (addr, at, row);
            r += 1;
        }
        let b = cursor.block;
        (out.src[b], out.dst[b], out.size[b]) = (gi, at, table as u64);
        cursor.block += 1;
        cursor.ring += row;
    }
    scratch.pairs = order;
    cursor.row = r;
    if host_src && !gpu.disjoint {
        let (addrs, sizes) = written_pages(
            out.src,
            out.dst,
            out.size,
            cursor.block - n..cursor.block,
            false,
        );
        check_written(&gpu.name, &addrs, &sizes, Overlap::Pages, scratch)?;
    }
    Ok(Prepared {
        // Blocks: the caller counts the slab's length once every group is written.
        len: n,
        bytes: row * n as u64,
        max_size,
        alignment: 1u64 << (bitmask | max_size).trailing_zeros().min(4),
        staged_rows: r - first_row,
        staged_blocks_at: 0,
        staged_blocks: 0,
    })
}

/// Completes a staged plan's slab once every group is written ([`expand_staged_into`] or
/// [`stage_cell_group`]): the cell plan's rows ([`finish_cells`]) and, CPU -> GPU where a GPU
/// table may share bytes between its pages, the check of what the kernel writes; then the
/// slab's length and where its block entries are.
pub(super) fn finish_staged(
    groups: &[Group<'_>],
    expansion: StagedExpansion,
    out: Columns<'_>,
    cursor: &mut StagedCursor,
    scratch: &mut Scratch,
    total: &mut Prepared,
) -> Result<(), TableError> {
    let StagedExpansion {
        rows,
        host_src,
        cells,
        slot,
        direct,
        ..
    } = expansion;
    if cells {
        let first = groups.first();
        let host = first.map_or("", |g| if host_src { &g.src.name } else { &g.dst.name });
        let Columns { src, dst, size } = out;
        let cols = Columns {
            src: &mut src[..],
            dst: &mut dst[..],
            size: &mut size[..],
        };
        total.staged_rows = if direct {
            // The entries keep their host addresses and go in order of geometry, then host
            // address, so that a launch takes a group's blocks together (a launch per run of one
            // geometry: two groups whose pages alternate in the cells, as gpt-oss-120b's do,
            // would otherwise alternate launch by launch). Nothing to check here: a group's
            // blocks are distinct (`check_ids`), its host pages apart block by block
            // (`staged_cell` holds only for a table whose pages are), and what two groups write
            // is checked where their tables are not proven apart (`expand_groups_into`).
            let Columns { src, dst, size } = cols;
            sort_entries([src, dst, size], rows..cursor.block, true);
            0
        } else {
            finish_cells(cols, cursor, host_src, slot, host, scratch)?
        };
        let gpu_shared = groups
            .iter()
            .any(|g| !(if host_src { g.dst } else { g.src }).disjoint);
        if host_src && gpu_shared {
            let (addrs, sizes) = written_pages(src, dst, size, rows..cursor.block, false);
            let name = first.map_or("", |g| g.dst.name.as_str());
            check_written(name, &addrs, &sizes, Overlap::Pages, scratch)?;
        }
    }
    // Rows, blocks from `rows` on, then the geometries: the slab's length counts all three.
    // The caller sized the rows by the groups' block counts (the cell plan: their pages),
    // which the checks above made exact; joined rows leave the end of that room unused.
    assert!(cursor.row <= rows, "staged rows sized wrong");
    total.len = cursor.table;
    total.staged_blocks_at = rows;
    total.staged_blocks = cursor.block - rows;
    Ok(())
}

/// The pages of block entry `i` of a staged slab's columns (see the module's layout), in table
/// order: `(ring offset, GPU address, bytes)`. Ring offsets count from the transfer's first row,
/// as the block entry's does. The slab must have been written by [`expand_staged_into`].
pub fn staged_pages<'a>(
    src: &'a [u64],
    dst: &'a [u64],
    size: &'a [u64],
    i: usize,
) -> impl Iterator<Item = (u64, u64, u64)> + 'a {
    let (id, ring, table) = (src[i], dst[i], size[i] as usize);
    let segments = src[table] as usize;
    // Holes (GPU base 0) are bytes of the row no page owns.
    (table + 1..table + 1 + segments)
        .filter(move |&s| src[s] != 0)
        .map(move |s| {
            let gpu = src[s].wrapping_add(id.wrapping_mul(dst[s]));
            (ring + size[s], gpu, size[s + 1] - size[s])
        })
}

/// The bytes of block entry `i`'s pages (holes not counted): its geometry's header.
fn block_bytes(size: &[u64], i: usize) -> u64 {
    size[size[i] as usize]
}

/// The ring bytes block entry `i` spans (its row, holes included): its geometry's last entry.
fn block_span(src: &[u64], size: &[u64], i: usize) -> u64 {
    let table = size[i] as usize;
    size[table + 1 + src[table] as usize]
}

/// Sorts block entries `blocks` (GPU id, host address or ring offset, geometry) by host address,
/// or `by_geometry` by geometry first.
fn sort_entries([src, dst, size]: [&mut [u64]; 3], blocks: Range<usize>, by_geometry: bool) {
    let key = |i: usize| {
        if by_geometry {
            (size[i], dst[i], src[i])
        } else {
            (dst[i], size[i], src[i])
        }
    };
    let mut order: Vec<(u64, u64, u64)> = blocks.clone().map(key).collect();
    order.sort_unstable();
    for (k, &(a, b, id)) in order.iter().enumerate() {
        let i = blocks.start + k;
        let (addr, table_at) = if by_geometry { (b, a) } else { (a, b) };
        (src[i], dst[i], size[i]) = (id, addr, table_at);
    }
}

/// The pages of block entries `blocks` of a staged slab, as `(addresses, bytes)`: what a
/// kernel writes, on the GPU (CPU -> GPU) or, with `ring` (a direct store, whose ring side holds
/// host addresses), on the host.
pub(super) fn written_pages(
    src: &[u64],
    dst: &[u64],
    size: &[u64],
    blocks: Range<usize>,
    ring: bool,
) -> (Vec<u64>, Vec<u64>) {
    blocks
        .flat_map(|i| staged_pages(src, dst, size, i))
        .map(|(r, gpu, bytes)| (if ring { r } else { gpu }, bytes))
        .unzip()
}

/// The staged plan of a transfer (see the module's documentation): the slab's first `rows`
/// entries are host rows `(address, ring offset, bytes)`, those from `first_block` on a block
/// entry per block, whose pages [`staged_pages`] names, their ring side an offset
/// from the transfer's first row. The backend moves the rows across `PCIe` one copy each into (or
/// out of) the slots of its staging ring, a step of whole rows per slot, and the pages between a
/// slot and the GPU pages with `kernel` (by memcpy on the host backend).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagedRequest {
    /// The host rows, the slab's first entries.
    pub rows: usize,
    /// Where the block entries start: the slab holds room for rows first (rows joined on the
    /// host leave the end of it unused).
    pub first_block: usize,
    /// The block entries.
    pub blocks: usize,
    /// Bytes of each of the two slots of a lane's ring; no row is larger.
    pub slot_bytes: u64,
    /// The fewest bytes a full step carries behind a running transfer, where the transfer has
    /// them ([`staged_full_steps`]).
    pub step_bytes: u64,
    /// From [`crate::backend::Backend::load_kernel`], a [`crate::kernel::KernelKind::Staged`] kernel; `None` where the backend
    /// copies pages with memcpy.
    pub kernel: Option<u32>,
    /// The direct plan: no rows and no ring. The block entries' ring side holds each block's host
    /// address (the cell plan's entries before [`finish_cells`] places them in a ring), and the
    /// kernel moves every page between the host and the GPU in place, reading its entries and
    /// geometries from device memory: a canonical page's fragments, too small and too scattered
    /// for the copy engines, then cross `PCIe` without a descriptor each. Steps are launches
    /// ([`direct_steps`]).
    pub direct: bool,
    /// The direct plan's most page bytes a launch moves (the other ranks' fragments between a
    /// rank's, the holes of its geometry, not counted): a launch holds its SMs until it ends, and
    /// each one more costs a refill of its pipeline (see `kernel_launch_bytes` in
    /// docs/tuning.md). `u64::MAX`: a launch per run of blocks of one geometry.
    pub launch_bytes: u64,
}

impl StagedRequest {
    /// The transfer's steps ([`staged_steps`]) from the slab's columns: its rows' ring offsets
    /// and bytes, and its block entries' ring offsets and spans; `behind`: an earlier transfer
    /// of the lane is still running (no ramps, and fewer steps for a small transfer: see
    /// [`STAGED_RAMP`] and [`STAGED_STEP_BYTES`]).
    #[must_use]
    pub fn steps(&self, src: &[u64], dst: &[u64], size: &[u64], behind: bool) -> Vec<StagedStep> {
        let (r, first) = (self.rows, self.first_block);
        let blocks = first..first + self.blocks;
        if self.direct {
            let moved: Vec<u64> = blocks.map(|i| block_bytes(size, i)).collect();
            return direct_steps(&moved, self.launch_bytes);
        }
        let ends: Vec<u64> = blocks
            .clone()
            .map(|i| dst[i] + block_span(src, size, i))
            .collect();
        staged_steps(
            &dst[..r],
            &size[..r],
            &dst[blocks],
            &ends,
            self.slot_bytes,
            self.step_bytes,
            behind,
        )
    }
}

/// The launches of a direct transfer (see [`StagedRequest::direct`]) whose blocks move `moved`
/// page bytes each: consecutive blocks, at most `launch_bytes` a launch (at least one block).
/// Counting page bytes, not a block's span, keeps a launch as long whatever the holes: at TP=4
/// a canonical cell is four times what rank 0 moves, and launches bounded by a 16 MiB span moved
/// 4 MiB each, 3-6.5 points of the link CPU -> GPU below launches of 16 MiB of pages
/// (Llama-3.1-8B and -70B, H100, 2026-11-27, `python benches/bench_canonical.py --tp 4`, the
/// span bound at 16 and 64 MiB; docs/benchmarks.md).
#[must_use]
pub fn direct_steps(moved: &[u64], launch_bytes: u64) -> Vec<StagedStep> {
    let mut steps = Vec::new();
    let (mut start, mut bytes) = (0usize, 0u64);
    for (b, &block) in moved.iter().enumerate() {
        if b > start && bytes.saturating_add(block) > launch_bytes {
            steps.push(StagedStep {
                rows: 0..0,
                blocks: start..b,
                ring_start: 0,
            });
            (start, bytes) = (b, 0);
        }
        bytes = bytes.saturating_add(block);
    }
    if start < moved.len() {
        steps.push(StagedStep {
            rows: 0..0,
            blocks: start..moved.len(),
            ring_start: 0,
        });
    }
    steps
}

/// A step is cut to at most `ceil(rows / STAGED_FULL_STEPS)` rows, so that a transfer of enough
/// rows runs in this many full steps over the two slots (fewer behind a running transfer: see
/// [`STAGED_STEP_BYTES`]): one step's copy across `PCIe` then overlaps the previous step's
/// kernel. One step per transfer held 4 KiB pages to 54-81 % of the link isolated, four 88-91 %
/// (H100, `benches/probe_staged.py`, docs/benchmarks.md).
pub const STAGED_FULL_STEPS: usize = 4;

/// The fewest bytes a full step carries behind a running transfer, where the transfer has them
/// (the default of the engine's `stage_step_bytes`): a transfer issued while an earlier one of
/// its lane runs, smaller than [`STAGED_FULL_STEPS`] of them, takes fewer steps
/// ([`staged_full_steps`]). Each step's batch of rows costs the copy engine a start, and CPU ->
/// GPU a costly one: 8 transfers of 10 MiB (4 KiB pages, 32 rows of 320 KiB) through the two
/// slots, queued, reached 99.6 / 98.1 / 92.9 / 88.8 % of the link CPU -> GPU in 1 / 2 / 4 / 8
/// steps a transfer, and 96.9 / 97.5 / 95.5 / 92.8 % GPU -> CPU; 40 MiB ones 100-101 % in 2 or 4
/// steps (H200, 2026-11-29, `python benches/probe_step_gaps.py --mib 10 --row-kib 320 --steps
/// 1,2,4,8`). Behind a running transfer every kernel but the burst's last overlaps a copy. An
/// isolated transfer keeps its full steps and its ramps: its whole kernel would overlap no copy,
/// and the engine's 4 KiB pages in one step ended 30-38 µs later CPU -> GPU than in four (`python
/// benches/bench_wall.py --variants steps4:stage_step_bytes=1` on a build that took it for
/// isolated transfers too; docs/benchmarks.md).
pub const STAGED_STEP_BYTES: u64 = 8 << 20;

/// The full steps of a staged transfer of `bytes` row bytes: one per `step_bytes`, at least one
/// and at most [`STAGED_FULL_STEPS`].
#[must_use]
pub fn staged_full_steps(bytes: u64, step_bytes: u64) -> usize {
    (bytes / step_bytes.max(1)).clamp(1, STAGED_FULL_STEPS as u64) as usize
}

/// The first and the last step take at most `1 / STAGED_RAMP` of a full step's rows: the first
/// step's kernel (GPU -> CPU: it fills the slot before any row crosses) and the last one's (CPU
/// -> GPU: it empties the slot after the last row) overlap no copy, and a quarter step's
/// kernel is a quarter as long. That kernel also runs on `STAGED_RAMP` times the kernel's CTAs
/// (where a step is one large cell, the ramp cannot cut it: 4 blocks per chunk, 5 MiB cells, a
/// 16 us kernel on 32 CTAs).
///
/// A transfer issued while an earlier one of its lane still runs takes no ramp: its first
/// kernel overlaps that transfer's last rows, its last one the next transfer's first, and each
/// step's batch of rows costs the copy engine a start (5-8 µs of GPU time between batches).
/// Queued 8 or 32 deep through the vLLM plug-in, the steady state rose 0.5-1.5 points of the
/// link that way (H200, 2026-11-28, `benches/probe_queued.py`, docs/benchmarks.md).
pub const STAGED_RAMP: usize = 4;

/// One step of a staged transfer: slab rows `rows`, block entries `blocks` (counted from the
/// first), and the ring offset of its first row (the slot's start).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagedStep {
    pub rows: std::ops::Range<usize>,
    pub blocks: std::ops::Range<usize>,
    pub ring_start: u64,
}

/// Cuts a staged slab into steps (see [`StagedRequest`]): whole rows, at most `slot_bytes` and
/// `ceil(rows / n)` rows each: `n` is [`STAGED_FULL_STEPS`], the first and the last step at
/// most a [`STAGED_RAMP`]th of that, unless the transfer is `behind` a running one of its lane,
/// where `n` is the full steps of the rows' bytes ([`staged_full_steps`] with `step_bytes`) and
/// no step is short; never between two rows a block spans (a cluster of the cell plan: its rows
/// go in one step even past that count); a step's blocks are those whose ring offset lies in
/// its rows. `block_ring`, `block_end`: the block entries' ring offsets and
/// ends. Rows and blocks come in ring order, as the table code writes them.
#[must_use]
pub fn staged_steps(
    row_ring: &[u64],
    row_bytes: &[u64],
    block_ring: &[u64],
    block_end: &[u64],
    slot_bytes: u64,
    step_bytes: u64,
    behind: bool,
) -> Vec<StagedStep> {
    let rows = row_ring.len();
    // Whether a step may end before row `e`: no block starting before it ends past its start.
    let mut cut = vec![true; rows + 1];
    let (mut p, mut reach) = (0usize, 0u64);
    for (e, &at) in row_ring.iter().enumerate().skip(1) {
        while p < block_ring.len() && block_ring[p] < at {
            reach = reach.max(block_end[p]);
            p += 1;
        }
        cut[e] = reach <= at;
    }
    let full = if behind {
        staged_full_steps(row_bytes.iter().sum(), step_bytes)
    } else {
        STAGED_FULL_STEPS
    };
    let per = rows.div_ceil(full).max(1);
    let ramp = if behind { 0 } else { per.div_ceil(STAGED_RAMP) };
    let mut steps = Vec::with_capacity(STAGED_FULL_STEPS + 3);
    let (mut r, mut p) = (0usize, 0usize);
    while r < rows {
        let start = row_ring[r];
        // The first step a ramp's rows; the others leave the last `ramp` rows to a step of
        // their own (behind a running transfer, no ramp: every step `per` rows).
        let cap = if ramp == 0 {
            per
        } else if r == 0 {
            ramp
        } else if rows - r > ramp {
            per.min(rows - r - ramp)
        } else {
            per
        };
        let mut end = r;
        while end < rows && end - r < cap && row_ring[end] + row_bytes[end] - start <= slot_bytes {
            end += 1;
        }
        // A row larger than a slot was refused before submission; never loop on one.
        let mut end = end.max(r + 1);
        if !cut[end] {
            // Back to the last cut in the step, else on to the cluster's end (a cluster fits a
            // slot: refused before submission otherwise).
            end = (r + 1..end)
                .rev()
                .find(|&e| cut[e])
                .unwrap_or_else(|| (end..=rows).find(|&e| cut[e]).unwrap_or(rows));
        }
        let ring_end = row_ring[end - 1] + row_bytes[end - 1];
        let first = p;
        while p < block_ring.len() && block_ring[p] < ring_end {
            p += 1;
        }
        steps.push(StagedStep {
            rows: r..end,
            blocks: first..p,
            ring_start: start,
        });
        r = end;
    }
    steps
}

#[cfg(test)]
mod tests;
