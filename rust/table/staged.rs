//! The staged plan's slab: host rows that cross `PCIe`, and the blocks whose pages a kernel
//! scatters out of (or gathers into) a device staging ring, each named by its block id and the
//! geometry of its table, so that no page has a descriptor of its own.
//!
//! A transfer of `rows` blocks in all lays out its slab as
//!
//! - `[0, rows)`: host rows `(row address, ring offset, bytes)`, rows of blocks that follow each
//!   other on the host joined (the room past the last row used stays empty);
//! - `[rows, 2 rows)`: one entry per block `(GPU block id, ring offset of its row, table at)`;
//! - from `2 rows` on, one geometry per group, at `table at`: a header `(segments, 0, 0)`, then
//!   per segment `s` `(GPU base, GPU stride, offset of the page in the row)`, then `(0, 0, row
//!   bytes)`, so that page `s` is `offsets[s + 1] - offsets[s]` bytes.
//!
//! Page `s` of a block is `GPU base[s] + id * GPU stride[s]` on the GPU and `ring offset +
//! offset[s]` in the ring: [`staged_pages`] walks them (the host backend, the tests), and the
//! CUDA backend's kernel computes them the same way. The slab for 32 blocks of 80 layers' K and
//! V pages holds 32 + 32 + 163 entries, not a descriptor per page (5,152): the submitting thread
//! writes a few hundred words, and the kernel's descriptors cross `PCIe` as a few KiB.

use std::ops::Range;

use super::{check_ids, check_written, BlockTable, Overlap, Pair, TableError};
use crate::descriptor::{Columns, Prepared, Scratch};

/// Slab entries of one group's geometry beyond its segments: the header and the row's end.
pub const STAGED_TABLE_EXTRA: usize = 2;

/// The bytes of one block's row in a block-major table (every segment of a block, in table
/// order, in one contiguous chunk at the block's stride), where the whole row of every block lies
/// in one registered region: what the staged plan moves across `PCIe` as one copy per block. `None`
/// for any other layout.
#[must_use]
pub fn staged_row(t: &BlockTable) -> Option<u64> {
    let stride = t.strides[0];
    let mut end = t.bases[0];
    for s in 0..t.segments() {
        if t.bases[s] != end || t.strides[s] != stride {
            return None;
        }
        end = end.checked_add(t.nbytes[s])?;
    }
    (t.disjoint && t.run_in_one_region(0, t.segments() - 1)).then_some(end - t.bases[0])
}

/// A host table's row where the staged plan can take it with slots of `slot` bytes: the table
/// block-major ([`staged_row`]) and its row no larger than a slot. Why not otherwise, as every
/// refusal of the plan (a submission, the handler's choice of route) words it.
pub fn staged_fit(host: &BlockTable, slot: u64) -> Result<u64, String> {
    match staged_row(host) {
        None => Err(
            "the host table is not block-major (a block's pages in one chunk inside one \
                     registered region)"
                .into(),
        ),
        Some(row) if row > slot => Err(format!(
            "a block's row is {row} bytes, more than a staging slot (stage_bytes = {slot})"
        )),
        Some(row) => Ok(row),
    }
}

/// Where [`expand_staged_into`] writes next: rows from `row` (room for `rows` of them), blocks
/// from `block`, geometries from `table`, ring offsets from `ring`. `merge`: the most bytes one
/// row may grow to by joining the next block's row where it continues on the host (0: never).
#[derive(Clone, Copy, Debug, Default)]
pub struct StagedCursor {
    pub rows: usize,
    pub row: usize,
    pub block: usize,
    pub table: usize,
    pub ring: u64,
    pub merge: u64,
}

impl StagedCursor {
    /// A cursor at the start of a slab for `rows` blocks in all.
    #[must_use]
    pub fn new(rows: usize, merge: u64) -> Self {
        StagedCursor {
            rows,
            row: 0,
            block: rows,
            table: 2 * rows,
            ring: 0,
            merge,
        }
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
    let Pair {
        src,
        src_ids,
        dst,
        dst_ids,
    } = pair;
    let (host, host_ids, gpu, gpu_ids) = if host_src {
        (src, src_ids, dst, dst_ids)
    } else {
        (dst, dst_ids, src, src_ids)
    };
    let row = staged_row(host).ok_or_else(|| {
        TableError::BadChunking(
            "the staged plan needs a block-major host table (a block's pages in one chunk)".into(),
        )
    })?;
    let segments = host.segments();
    let n = src_ids.len();
    let table = cursor.table;
    assert!(
        cursor.row + n <= cursor.rows
            && cursor.block + n <= 2 * cursor.rows
            && table + segments + STAGED_TABLE_EXTRA <= out.src.len(),
        "slab too small"
    );
    let mut bitmask = row;
    let mut max_size = 0u64;
    out.src[table] = segments as u64;
    (out.dst[table], out.size[table]) = (0, 0);
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
    for (&hi, &gi) in host_ids.iter().zip(gpu_ids) {
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
    cursor.row = r;
    if host_src && !gpu.disjoint {
        let (addrs, sizes) =
            written_pages(out.src, out.dst, out.size, cursor.block - n..cursor.block);
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
    })
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
    (table + 1..table + 1 + segments).map(move |s| {
        let gpu = src[s].wrapping_add(id.wrapping_mul(dst[s]));
        (ring + size[s], gpu, size[s + 1] - size[s])
    })
}

/// The GPU pages of block entries `blocks` of a staged slab, as `(addresses, bytes)`: what a
/// CPU -> GPU transfer's kernel writes.
pub(super) fn written_pages(
    src: &[u64],
    dst: &[u64],
    size: &[u64],
    blocks: Range<usize>,
) -> (Vec<u64>, Vec<u64>) {
    blocks
        .flat_map(|i| staged_pages(src, dst, size, i))
        .map(|(_, gpu, bytes)| (gpu, bytes))
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
    /// Where the block entries start, and how many there are: the slab holds room for a row
    /// per block first (rows joined on the host leave the end of it unused).
    pub first_block: usize,
    /// Bytes of each of the two slots of a lane's ring; no row is larger.
    pub slot_bytes: u64,
    /// From [`crate::backend::Backend::load_kernel`], a [`crate::kernel::KernelKind::Staged`] kernel; `None` where the backend
    /// copies pages with memcpy.
    pub kernel: Option<u32>,
}

impl StagedRequest {
    /// The transfer's steps ([`staged_steps`]) from the slab's destination and size columns:
    /// its rows' ring offsets and bytes, and its block entries' ring offsets.
    #[must_use]
    pub fn steps(&self, dst: &[u64], size: &[u64]) -> Vec<StagedStep> {
        let (r, first) = (self.rows, self.first_block);
        staged_steps(
            &dst[..r],
            &size[..r],
            &dst[first..2 * first],
            self.slot_bytes,
        )
    }
}

/// A step is cut to at most `ceil(rows / STAGED_MIN_STEPS)` rows, so that a transfer of enough
/// rows runs in at least this many steps over the two slots: one step's copy across `PCIe` then
/// overlaps the previous step's kernel. One step per transfer held 4 KiB pages to 54-81 % of the
/// link isolated, four 88-91 % (H100, `benches/probe_staged.py`, docs/benchmarks.md).
pub const STAGED_MIN_STEPS: usize = 4;

/// One step of a staged transfer: slab rows `rows`, block entries `blocks` (counted from the
/// first), and the ring offset of its first row (the slot's start).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagedStep {
    pub rows: std::ops::Range<usize>,
    pub blocks: std::ops::Range<usize>,
    pub ring_start: u64,
}

/// Cuts a staged slab into steps (see [`StagedRequest`]): whole rows, at most `slot_bytes` and
/// `ceil(rows / STAGED_MIN_STEPS)` rows each; a step's blocks are those whose ring offset lies in
/// its rows. `block_ring`: the block entries' ring offsets. Rows and blocks come in ring order,
/// as the table code writes them.
#[must_use]
pub fn staged_steps(
    row_ring: &[u64],
    row_bytes: &[u64],
    block_ring: &[u64],
    slot_bytes: u64,
) -> Vec<StagedStep> {
    let rows = row_ring.len();
    let per = rows.div_ceil(STAGED_MIN_STEPS).max(1);
    let mut steps = Vec::with_capacity(STAGED_MIN_STEPS + 1);
    let (mut r, mut p) = (0usize, 0usize);
    while r < rows {
        let start = row_ring[r];
        let mut end = r;
        while end < rows && end - r < per && row_ring[end] + row_bytes[end] - start <= slot_bytes {
            end += 1;
        }
        // A row larger than a slot was refused before submission; never loop on one.
        let end = end.max(r + 1);
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
