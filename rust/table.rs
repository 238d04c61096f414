//! Block tables: transfers named by block ids instead of addresses.
//!
//! A KV cache is a few tensors whose blocks sit at fixed strides. A block table describes one side
//! of it once (segment `s` of block `b` is `nbytes[s]` bytes at `bases[s] + b * strides[s]`), and
//! is checked once, when registered, against the memory the engine knows: every segment's pages
//! must lie in registered memory of the table's kind, its whole span in one region or several
//! adjacent ones (a large host buffer is registered in pieces), or else each page in them with
//! unregistered bytes between pages (one rank's cells of a region several ranks share, registered
//! a cell each), and no page crossing from one region into the next. A transfer then only names
//! block ids; [`expand_into`] checks them (in range; destinations unique) and writes the
//! descriptors straight into a pool slab, segment-major and block-minor so that runs of
//! consecutive blocks coalesce. No address from the caller is ever copied from unchecked, and no
//! descriptor or 2-D copy crosses a boundary between two regions.
//!
//! Every plan (pages, the block plan's 2-D copies, the staged plan) keeps one rule for what a
//! transfer writes: no byte twice, else the result would depend on the order of the copies.
//! Where the destination table's geometry proves it (distinct ids, segments that share no byte)
//! nothing is sorted; a table whose segments share memory in every block (layers that view one
//! tensor) is refused as a destination by `check_ids` whatever the ids, and anything else is
//! checked by `check_written` on what the plan wrote.

use crate::descriptor::{check_disjoint, Columns, DescriptorError, Prepared, Scratch, Side};
use crate::region::{MemoryKind, RegionTable};

mod chunks;
mod error;
mod geometry;
mod groups;
mod runs;
mod staged;
mod tensor;
pub use chunks::{chunk_blocks, chunk_count, chunk_skip, cut_spec, map_chunks, SpecPiece};
pub use error::{Overlap, TableError};
pub use geometry::{merged_spans, segment_spans, segments_disjoint};
use geometry::{pages_disjoint, shared_segments};
pub use groups::{expand_groups_into, Expansion, Group};
use runs::written_rows;
pub use runs::{
    block_route, block_runs, expand_runs_into, for_each_row, Run, BLOCK_MAX_COPIES, BLOCK_MIN_PAGE,
    MAX_PITCH, PITCHED_ENTRIES,
};
pub use staged::{
    direct_steps, expand_staged_into, finish_cells, stage_cell_group, staged_cell, staged_cells,
    staged_fit, staged_full_steps, staged_pages, staged_row, staged_steps, StagedCursor,
    StagedExpansion, StagedRequest, StagedStep, STAGED_FULL_STEPS, STAGED_RAMP, STAGED_STEP_BYTES,
    STAGED_TABLE_EXTRA,
};
use staged::{finish_staged, written_pages};
pub use tensor::{block_major_views, mirror, tensor_segments, BlockMajor, Mirror, TensorSegments};

/// A block table as its caller describes it, before it is checked against registered memory
/// (see [`TableSpec::build`]): `bases`, `strides` and `nbytes` per segment, `num_blocks` blocks of
/// `kind` memory; `name` and `unit` only shape error messages (see [`BlockTable::named`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableSpec {
    pub bases: Vec<u64>,
    pub strides: Vec<u64>,
    pub nbytes: Vec<u64>,
    pub num_blocks: u64,
    pub kind: MemoryKind,
    pub name: String,
    pub unit: u64,
}

impl TableSpec {
    /// An unnamed table counting single blocks (`name` empty, `unit` 1).
    #[must_use]
    pub fn new(
        bases: Vec<u64>,
        strides: Vec<u64>,
        nbytes: Vec<u64>,
        num_blocks: u64,
        kind: MemoryKind,
    ) -> Self {
        TableSpec {
            bases,
            strides,
            nbytes,
            num_blocks,
            kind,
            name: String::new(),
            unit: 1,
        }
    }

    /// Names the table's blocks in errors, counting `unit` table blocks per named block.
    #[must_use]
    pub fn named(mut self, name: &str, unit: u64) -> Self {
        self.name = name.to_string();
        self.unit = unit;
        self
    }

    /// Checks the table against `regions` (and `unit` against `num_blocks`) and builds it
    /// ([`BlockTable::new`], then [`BlockTable::named`]).
    pub fn build(self, regions: &RegionTable) -> Result<BlockTable, TableError> {
        let TableSpec {
            bases,
            strides,
            nbytes,
            num_blocks,
            kind,
            name,
            unit,
        } = self;
        if unit > num_blocks {
            return Err(TableError::BadChunking(format!(
                "unit {unit} is more than the table's {num_blocks} blocks: a block the caller \
                 names would not fit in it"
            )));
        }
        Ok(BlockTable::new(bases, strides, nbytes, num_blocks, kind, regions)?.named(&name, unit))
    }
}

/// One side of a KV cache: `bases`, `strides` and `nbytes` per segment, `num_blocks` blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockTable {
    pub bases: Vec<u64>,
    pub strides: Vec<u64>,
    pub nbytes: Vec<u64>,
    pub num_blocks: u64,
    pub kind: MemoryKind,
    /// How errors name the table's blocks ("GPU", "CPU"); empty: by side.
    pub name: String,
    /// Table blocks per caller-visible block (a CPU block of `unit` GPU-sized sub-blocks):
    /// errors report `id / unit`.
    pub unit: u64,
    /// Distinct (segment, block) pairs never share a byte: unique destination block ids then
    /// prove disjoint destinations without sorting.
    disjoint: bool,
    /// Two segments whose pages share bytes in every block (see [`shared_segments`]): the table
    /// can be a source, never a destination.
    shared: Option<(usize, usize)>,
    /// Per segment, the start of the driver allocation it lies in, where the backend knows
    /// (see [`BlockTable::in_allocations`]): a block plan's run never crosses from one to another.
    allocations: Vec<Option<u64>>,
    /// Boundaries no copy may cross, sorted: the start of every region after the first that a
    /// segment's pages lie in, and every seam (the start of a piece of a host buffer) inside the
    /// table's span. No page contains one strictly inside it (checked at registration);
    /// descriptors and 2-D copies never join pages across one.
    cuts: Vec<u64>,
    /// `[lowest byte, end)` over every segment: tables whose spans are apart share no byte.
    span: (u64, u64),
}

/// The first of `cuts` (sorted) strictly inside the range of `extent` bytes from `start + b *
/// stride` of some block `b` in `0..num_blocks`, with that block: `(block, cut)`. A page
/// (`extent` = its bytes) or a block's 2-D copy (`extent` = from its first row's start to its
/// last row's end) must contain none. The ranges must not overflow (checked at registration).
fn crossing(
    start: u64,
    stride: u64,
    num_blocks: u64,
    extent: u64,
    cuts: &[u64],
) -> Option<(u64, u64)> {
    let last = num_blocks.max(1) - 1;
    let stride = if last == 0 { 0 } else { stride };
    let reach = last * stride + extent;
    let from = cuts.partition_point(|&c| c <= start);
    for &c in &cuts[from..] {
        let d = c - start;
        if d >= reach {
            break;
        }
        // The last block starting before the cut: it reaches furthest past it of all the blocks
        // that start before it.
        let b = (d - 1).checked_div(stride).map_or(0, |b| b.min(last));
        if b * stride + extent > d {
            return Some((b, c));
        }
    }
    None
}

impl BlockTable {
    /// Whether `other` names the same pages for every block id (the same table, or one
    /// registered again with the same geometry).
    fn same_pages(&self, other: &BlockTable) -> bool {
        std::ptr::eq(self, other)
            || (self.num_blocks == other.num_blocks
                && self.bases == other.bases
                && self.strides == other.strides
                && self.nbytes == other.nbytes)
    }

    /// Whether a boundary no copy may cross lies at `addr` (see `cuts`).
    fn cut_at(&self, addr: u64) -> bool {
        self.cuts.binary_search(&addr).is_ok()
    }

    /// Checks a table against `regions` and builds it.
    pub fn new(
        bases: Vec<u64>,
        strides: Vec<u64>,
        nbytes: Vec<u64>,
        num_blocks: u64,
        kind: MemoryKind,
        regions: &RegionTable,
    ) -> Result<Self, TableError> {
        let n = bases.len();
        if strides.len() != n || nbytes.len() != n || n == 0 || num_blocks == 0 {
            return Err(TableError::BadSegment {
                segment: 0,
                reason: format!(
                    "{n} bases, {} strides, {} sizes and {num_blocks} blocks: need at least one \
                     segment and one block, and equal lengths",
                    strides.len(),
                    nbytes.len()
                ),
            });
        }
        let mut spans = Vec::with_capacity(n);
        let mut covers = Vec::with_capacity(n);
        let mut cuts = Vec::new();
        for s in 0..n {
            let (base, stride, size) = (bases[s], strides[s], nbytes[s]);
            let bad = |reason: &str| TableError::BadSegment {
                segment: s,
                reason: reason.into(),
            };
            if size == 0 {
                return Err(bad("zero bytes per page"));
            }
            if num_blocks > 1 && stride < size {
                return Err(bad("the stride between blocks is smaller than a page"));
            }
            let len = (num_blocks - 1)
                .checked_mul(stride)
                .and_then(|x| x.checked_add(size))
                .filter(|&len| base.checked_add(len).is_some())
                .ok_or_else(|| bad("the segment's span overflows the address space"))?;
            // Each page in one region or adjacent ones, with or without unregistered bytes between
            // pages (one rank's cells of a shared region, registered a cell each).
            let cover = regions
                .cover_pages(base, stride, num_blocks, size, kind)
                .map_err(|b| TableError::NotRegistered {
                    segment: s,
                    start: base + b * stride,
                    len: size,
                    kind,
                })?;
            covers.push(cover);
            spans.push((base, len));
        }
        // Every region start after the first in a segment's cover is a boundary: pages that meet
        // there lie in two registrations, and pages that do not meet are never joined. Segments
        // of one table mostly share their cover (a cell per row holds every tensor's pages), so
        // each region is counted once.
        covers.sort_unstable_by_key(|c| (c.start, c.end));
        let mut next = 0;
        for c in covers {
            let from = (c.start + 1).max(next);
            if from < c.end {
                cuts.extend(regions.regions()[from..c.end].iter().map(|r| r.start));
            }
            next = next.max(c.end);
        }
        let (lo, hi) = spans.iter().fold((u64::MAX, 0), |(lo, hi), &(b, len)| {
            (lo.min(b), hi.max(b + len))
        });
        // Segments in different pieces of one host buffer: a block's 2-D copy may not join
        // them, though no span crosses from one into the other.
        cuts.extend(regions.seams(lo, hi));
        cuts.sort_unstable();
        cuts.dedup();
        // A boundary strictly inside a page is inside its segment's span, so one of the
        // boundaries between the regions covering it: each segment is checked against them all.
        for s in 0..n {
            let (base, stride, size) = (bases[s], strides[s], nbytes[s]);
            if let Some((block, boundary)) = crossing(base, stride, num_blocks, size, &cuts) {
                return Err(TableError::Straddles {
                    segment: s,
                    block,
                    page: base + block * stride,
                    nbytes: size,
                    boundary,
                });
            }
        }
        let disjoint = pages_disjoint(&spans, &bases, &strides, &nbytes, num_blocks);
        let shared = if disjoint {
            None
        } else {
            shared_segments(&bases, &strides, &nbytes, num_blocks)
        };
        let span = (lo, hi);
        Ok(BlockTable {
            bases,
            strides,
            nbytes,
            num_blocks,
            kind,
            name: String::new(),
            unit: 1,
            disjoint,
            shared,
            allocations: vec![None; n],
            cuts,
            span,
        })
    }

    /// The boundaries no copy of the table may cross, sorted: between the adjacent regions a
    /// segment's span lies in, and the seams inside the table's span (empty where every segment
    /// lies in one region and no seam is near).
    #[must_use]
    pub fn cuts(&self) -> &[u64] {
        &self.cuts
    }

    /// Whether a region boundary lies at `addr`: two pages that meet there are not joined.
    #[inline]
    fn is_cut(&self, addr: u64) -> bool {
        !self.cuts.is_empty() && self.cuts.binary_search(&addr).is_ok()
    }

    /// Whether no block's rows of a 2-D copy from segment `first` through segment `last` (at one
    /// block stride, bases increasing) cross a region boundary.
    fn run_in_one_region(&self, first: usize, last: usize) -> bool {
        self.cuts.is_empty() || {
            let extent = self.bases[last] + self.nbytes[last] - self.bases[first];
            crossing(
                self.bases[first],
                self.strides[first],
                self.num_blocks,
                extent,
                &self.cuts,
            )
            .is_none()
        }
    }

    /// Records the driver allocation of each segment (`base(address)`: the allocation's start, or
    /// `None` where the memory has no such bound), which block plans respect.
    #[must_use]
    pub fn in_allocations(mut self, base: impl Fn(u64) -> Option<u64>) -> Self {
        self.allocations = self.bases.iter().map(|&b| base(b)).collect();
        self
    }

    /// Names the table's blocks in errors, counting `unit` table blocks per named block.
    #[must_use]
    pub fn named(mut self, name: &str, unit: u64) -> Self {
        self.name = name.to_string();
        self.unit = unit.max(1);
        self
    }

    fn label(&self, side: Side) -> String {
        match (self.name.is_empty(), side) {
            (false, _) => self.name.clone(),
            (true, Side::Src) => "source".into(),
            (true, Side::Dst) => "destination".into(),
        }
    }

    /// Whether the table touches `[start, end)`.
    #[must_use]
    pub fn overlaps(&self, start: u64, end: u64) -> bool {
        (0..self.bases.len()).any(|s| {
            let len = (self.num_blocks - 1) * self.strides[s] + self.nbytes[s];
            self.bases[s] < end && start < self.bases[s] + len
        })
    }

    #[must_use]
    pub fn segments(&self) -> usize {
        self.bases.len()
    }

    /// Two segments whose pages share bytes in every block (layers that view one tensor), the
    /// lower first: a transfer into the table is refused whatever its ids
    /// ([`Overlap::Segments`]), a transfer out of it reads those bytes twice. `None` otherwise.
    #[must_use]
    pub fn shared_segments(&self) -> Option<(usize, usize)> {
        self.shared
    }

    fn compatible(&self, dst: &BlockTable) -> Result<(), TableError> {
        compatibility(&self.nbytes, &dst.nbytes)
    }
}

/// Whether blocks of a table whose segments' pages are `src` bytes may be copied to one whose
/// are `dst`: the same segment count and sizes, in order. The one rule, for a transfer's pair as
/// for a CPU cache checked against its GPU cache (`_core.table_incompatibility`).
pub fn compatibility(src: &[u64], dst: &[u64]) -> Result<(), TableError> {
    if src == dst {
        return Ok(());
    }
    let detail = match (0..src.len().min(dst.len())).find(|&s| src[s] != dst[s]) {
        Some(s) => format!(
            "; segment {s} has {} source bytes per page and {} destination bytes",
            src[s], dst[s]
        ),
        None => String::new(),
    };
    Err(TableError::Incompatible {
        src_segments: src.len(),
        dst_segments: dst.len(),
        detail,
    })
}

/// The two sides of a block-id transfer: blocks `src_ids` of `src` to blocks `dst_ids` of `dst`.
#[derive(Clone, Copy, Debug)]
pub struct Pair<'a> {
    pub src: &'a BlockTable,
    pub src_ids: &'a [u64],
    pub dst: &'a BlockTable,
    pub dst_ids: &'a [u64],
}

/// The checks every block-id transfer passes before a descriptor is written: equal lengths, at
/// least one block, compatible pages, every id in range, destinations distinct, and a destination
/// table whose segments do not share memory in every block (see [`BlockTable::shared_segments`]).
/// With them, a plan's destinations are disjoint where the destination table is
/// ([`BlockTable::disjoint`]); each plan proves the rest with [`check_written`].
fn check_ids(pair: Pair<'_>, scratch: &mut Scratch) -> Result<(), TableError> {
    let Pair {
        src,
        src_ids,
        dst,
        dst_ids,
    } = pair;
    let n = src_ids.len();
    if dst_ids.len() != n {
        return Err(TableError::LengthMismatch {
            src: n,
            dst: dst_ids.len(),
        });
    }
    if n == 0 {
        return Err(TableError::Empty);
    }
    src.compatible(dst)?;
    for (side, ids, table) in [(Side::Src, src_ids, src), (Side::Dst, dst_ids, dst)] {
        if let Some(index) = ids.iter().position(|&id| id >= table.num_blocks) {
            // Ids came from int64: one past 2**63 here was negative, and is named as given.
            let raw = ids[index] as i64;
            let id = if raw < 0 {
                raw
            } else {
                (ids[index] / table.unit) as i64
            };
            let (name, num_blocks) = (table.label(side), table.num_blocks / table.unit);
            return Err(TableError::OutOfRange {
                name,
                index,
                id,
                num_blocks,
            });
        }
    }
    if let Err(index) = unique(
        dst_ids,
        dst.num_blocks,
        &mut scratch.bits,
        &mut scratch.pairs,
    ) {
        let (name, id) = (dst.label(Side::Dst), dst_ids[index] / dst.unit);
        return Err(TableError::DuplicateDestination { name, index, id });
    }
    if let Some((a, b)) = dst.shared {
        let page = |s: usize| (dst.bases[s] + dst_ids[0] * dst.strides[s], dst.nbytes[s]);
        return Err(TableError::OverlappingDestinations {
            table: dst.name.clone(),
            first: page(a),
            second: page(b),
            within: Overlap::Segments(a, b),
        });
    }
    Ok(())
}

/// The rule every plan keeps for what one transfer writes: no byte twice. Proves the ranges
/// `[addrs[i], + sizes[i])` (the pages, 2-D copies' rows or staged pages a plan wrote) pairwise
/// disjoint, or names two that overlap ([`TableError::OverlappingDestinations`], `within` one
/// table of `table`'s name or across groups). A plan calls it where its destination table is not
/// proven disjoint by its geometry, or where groups' destination tables share memory.
fn check_written(
    table: &str,
    addrs: &[u64],
    sizes: &[u64],
    within: Overlap,
    scratch: &mut Scratch,
) -> Result<(), TableError> {
    check_disjoint(addrs, sizes, scratch).map_err(|e| match e {
        DescriptorError::OverlappingDestinations { first, second } => {
            TableError::OverlappingDestinations {
                table: table.to_string(),
                first,
                second,
                within,
            }
        }
        e => TableError::BadSegment {
            segment: 0,
            reason: e.to_string(),
        },
    })
}

/// Checks block ids and writes the transfer's descriptors into `out`: for each segment, for each
/// block pair, `(src base + src id * stride, dst base + dst id * stride, nbytes)`, merging a
/// descriptor into the previous one when both its addresses continue it (same segment only, and
/// not across a boundary between two registered regions on either side).
///
/// Ids are the caller's int64 values read as u64 (negative ones become huge and are refused as
/// out of range). `scratch` holds the reusable bitset of the uniqueness check. `out` must have
/// room for `segments * ids` descriptors.
pub fn expand_into(
    pair: Pair<'_>,
    coalesce: bool,
    out: Columns<'_>,
    scratch: &mut Scratch,
) -> Result<Prepared, TableError> {
    check_ids(pair, scratch)?;
    let Pair {
        src,
        src_ids,
        dst,
        dst_ids,
    } = pair;
    let n = src_ids.len();
    let segments = src.segments();
    assert!(out.src.len() >= segments * n, "slab too small");
    let mut w = 0usize;
    let mut bytes = 0u64;
    let mut max_size = 0u64;
    let mut bitmask = 0u64;
    // Which block pairs continue the previous pair: it depends on the segment only through
    // (source stride, destination stride, page bytes), which most caches share across all
    // segments, so it is worked out once per distinct triple rather than per descriptor.
    let merge = &mut scratch.merge;
    let mut merge_key = None;
    let mut any_merge = false;
    let cuts = !src.cuts.is_empty() || !dst.cuts.is_empty();
    for s in 0..segments {
        let (sb, ss, db, ds, z) = (
            src.bases[s],
            src.strides[s],
            dst.bases[s],
            dst.strides[s],
            src.nbytes[s],
        );
        bitmask |= sb | ss | db | ds | z;
        if coalesce && merge_key != Some((ss, ds, z)) {
            merge_key = Some((ss, ds, z));
            merge.clear();
            merge.push(false);
            merge.extend((1..n).map(|i| {
                src_ids[i].wrapping_sub(src_ids[i - 1]).wrapping_mul(ss) == z
                    && dst_ids[i].wrapping_sub(dst_ids[i - 1]).wrapping_mul(ds) == z
            }));
            any_merge = merge.iter().any(|&m| m);
        }
        let start = w;
        if any_merge {
            for i in 0..n {
                // Pages that continue each other across a region boundary stay two descriptors.
                let joins = merge[i]
                    && !(cuts
                        && (src.is_cut(sb + src_ids[i] * ss) || dst.is_cut(db + dst_ids[i] * ds)));
                if joins {
                    out.size[w - 1] += z;
                } else {
                    // In range by the checks above; the spans were proven not to overflow.
                    out.src[w] = sb + src_ids[i] * ss;
                    out.dst[w] = db + dst_ids[i] * ds;
                    out.size[w] = z;
                    w += 1;
                }
            }
            max_size = max_size.max(out.size[start..w].iter().copied().max().unwrap_or(0));
        } else {
            let (os, od, oz) = (
                &mut out.src[w..w + n],
                &mut out.dst[w..w + n],
                &mut out.size[w..w + n],
            );
            for i in 0..n {
                os[i] = sb + src_ids[i] * ss;
                od[i] = db + dst_ids[i] * ds;
                oz[i] = z;
            }
            w += n;
            max_size = max_size.max(z);
        }
        // `z * n` fits: the ids are distinct, so `n` pages lie within the segment's span. The sum
        // wraps only where destinations overlap, which the check below refuses.
        bytes = bytes.wrapping_add(z * n as u64);
    }
    if !dst.disjoint {
        check_written(
            &dst.name,
            &out.dst[..w],
            &out.size[..w],
            Overlap::Pages,
            scratch,
        )?;
    }
    // Addresses are base + id * stride: their alignment is that of the bases and strides.
    let alignment = 1u64 << (bitmask | max_size).trailing_zeros().min(4);
    Ok(Prepared {
        len: w,
        bytes,
        max_size,
        alignment,
        staged_rows: 0,
        staged_blocks_at: 0,
        staged_blocks: 0,
    })
}

/// The largest bitset [`unique`] keeps: 8 MiB, a table of 2^26 blocks. Larger tables (only a
/// pathological registration makes one) are checked by sorting the ids instead, so the bitset
/// stays bounded whatever the table.
const MAX_BITSET_WORDS: u64 = 1 << 20;

/// The position of the first repeated id, if any, with a bitset over `0..num_blocks` left all
/// clear afterwards (or, past [`MAX_BITSET_WORDS`], by sorting `(id, position)` pairs).
fn unique(
    ids: &[u64],
    num_blocks: u64,
    bits: &mut Vec<u64>,
    pairs: &mut Vec<(u64, u64)>,
) -> Result<(), usize> {
    let words = num_blocks.div_ceil(64);
    if words > MAX_BITSET_WORDS {
        pairs.clear();
        pairs.extend(ids.iter().enumerate().map(|(i, &id)| (id, i as u64)));
        pairs.sort_unstable();
        // Within a run of one id the second pair is its first repetition; the earliest of those.
        return pairs
            .windows(2)
            .filter(|w| w[0].0 == w[1].0)
            .map(|w| w[1].1 as usize)
            .min()
            .map_or(Ok(()), Err);
    }
    let words = words as usize;
    if bits.len() < words {
        bits.resize(words, 0);
    }
    let mut dup = None;
    for (i, &id) in ids.iter().enumerate() {
        let (word, bit) = ((id / 64) as usize, 1u64 << (id % 64));
        if bits[word] & bit != 0 {
            dup = Some(i);
            break;
        }
        bits[word] |= bit;
    }
    let set = dup.unwrap_or(ids.len());
    for &id in &ids[..set] {
        bits[(id / 64) as usize] &= !(1u64 << (id % 64));
    }
    dup.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod group_tests;

#[cfg(test)]
mod props;

#[cfg(test)]
mod boundaries;

#[cfg(test)]
mod overlap_tests;
