//! Descriptor batches: `(src address, dst address, byte size)` triples, their validation, and the
//! coalescing of contiguous runs.
//!
//! A batch is three parallel arrays (structure of arrays), the layout `cuMemcpyBatchAsync` takes
//! and the layout the Python layer builds with numpy, so nothing is transposed on the hot path.
//!
//! [`prepare_into`] is the one pass every transfer goes through: it checks each descriptor (size,
//! overflow, the memory regions it must lie in), merges neighbours whose source and destination
//! both continue each other, writes the result into a pool slab, and finally proves that no two
//! destinations overlap.

use std::fmt;

use crate::region::{MemoryKind, RegionTable};

pub use crate::direction::Direction;
pub use disjoint::{check_disjoint, BUCKETS_PER_RANGE, SLOTS_PER_RANGE};

mod disjoint;

/// Which address of a descriptor an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Src,
    Dst,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Src => "source",
            Side::Dst => "destination",
        })
    }
}

/// A batch that cannot be copied. Indexes are positions in the caller's arrays.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DescriptorError {
    /// The three arrays differ in length.
    LengthMismatch { src: usize, dst: usize, size: usize },
    /// The batch holds no descriptor.
    Empty,
    /// More descriptors than one transfer may carry.
    TooLarge { len: usize, max: usize },
    /// A descriptor of zero bytes.
    ZeroSize { index: usize },
    /// A size that is negative when read as the signed 64-bit integer the caller passed.
    NegativeSize { index: usize, value: i64 },
    /// `address + size` does not fit in 64 bits.
    AddressOverflow {
        index: usize,
        side: Side,
        addr: u64,
        size: u64,
    },
    /// The range is not inside one registered region of the kind the direction needs.
    OutOfRegion {
        index: usize,
        side: Side,
        addr: u64,
        size: u64,
        kind: MemoryKind,
    },
    /// Two destination ranges of one batch overlap: the result would depend on copy order.
    OverlappingDestinations {
        first: (u64, u64),
        second: (u64, u64),
    },
}

impl fmt::Display for DescriptorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            DescriptorError::LengthMismatch { src, dst, size } => write!(
                f,
                "src_ptrs, dst_ptrs and sizes differ in length ({src}, {dst}, {size})"
            ),
            DescriptorError::Empty => f.write_str("the batch holds no descriptor"),
            DescriptorError::TooLarge { len, max } => {
                write!(
                    f,
                    "{len} descriptors in one transfer; at most {max} are allowed"
                )
            }
            DescriptorError::ZeroSize { index } => write!(f, "sizes[{index}] is zero"),
            DescriptorError::NegativeSize { index, value } => {
                write!(f, "sizes[{index}] is negative ({value})")
            }
            DescriptorError::AddressOverflow {
                index,
                side,
                addr,
                size,
            } => write!(
                f,
                "{side} range of descriptor {index} overflows: {addr:#x} + {size} bytes"
            ),
            DescriptorError::OutOfRegion {
                index,
                side,
                addr,
                size,
                kind,
            } => write!(
                f,
                "{side} range of descriptor {index} ({addr:#x}, {size} bytes) is not inside \
                 registered {kind} memory (one region: no copy crosses from one region into the \
                 next)"
            ),
            DescriptorError::OverlappingDestinations { first, second } => write!(
                f,
                "destinations overlap: [{:#x}, +{}) and [{:#x}, +{})",
                first.0, first.1, second.0, second.1
            ),
        }
    }
}

impl std::error::Error for DescriptorError {}

/// What [`prepare_into`] wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Prepared {
    /// Descriptors written (after coalescing).
    pub len: usize,
    /// Total bytes of the batch.
    pub bytes: u64,
    /// The largest descriptor after coalescing.
    pub max_size: u64,
    /// The largest power of two (capped at 16) dividing every address and size.
    pub alignment: u64,
    /// Of `len`, the host rows that lead a staged plan's slab (see
    /// [`crate::table::expand_staged_into`]); 0 for every other plan.
    pub staged_rows: usize,
    /// Where a staged plan's block entries start in the slab (rows joined on the host leave
    /// room unused before it); 0 for every other plan.
    pub staged_blocks_at: usize,
    /// A staged plan's block entries; 0 for every other plan.
    pub staged_blocks: usize,
}

/// The output arrays of [`prepare_into`]: a slab's three columns.
#[derive(Debug)]
pub struct Columns<'a> {
    pub src: &'a mut [u64],
    pub dst: &'a mut [u64],
    pub size: &'a mut [u64],
}

/// Checks a caller's batch and writes it, coalesced, into `out`.
///
/// Every descriptor must have a positive size, must not overflow the address space, and must lie
/// within one registered region of `direction.src_kind()` (sources) or `direction.dst_kind()`
/// (destinations). With `coalesce`, a descriptor whose source and destination both start where
/// the previous one ended, in the same regions, extends it; nothing merges across a gap. After
/// the pass, destinations are proven pairwise disjoint: in the same pass when they come in
/// ascending order (the common case), by [`check_disjoint`] otherwise.
///
/// The batch goes in blocks of [`BLOCK`] descriptors. A block whose descriptors all lie in the
/// regions of the last one located, none continuing its predecessor, is checked by one branch-free
/// pass and copied out as it is; any other block (another region, a descriptor to merge, a bad
/// one) goes through the exact pass, descriptor by descriptor, which finds each one's region and
/// names the first bad descriptor. Both give the same result: the fast pass only decides that
/// nothing needs the exact one.
///
/// `out` must have room for `src.len()` descriptors. On error `out` holds garbage and nothing was
/// issued: the caller returns the slab to the pool.
pub fn prepare_into(
    batch: Batch<'_>,
    direction: Direction,
    regions: &RegionTable,
    coalesce: bool,
    mut out: Columns<'_>,
    scratch: &mut Scratch,
) -> Result<Prepared, DescriptorError> {
    let Batch { src, dst, size } = batch;
    let n = src.len();
    if dst.len() != n || size.len() != n {
        return Err(DescriptorError::LengthMismatch {
            src: n,
            dst: dst.len(),
            size: size.len(),
        });
    }
    if n == 0 {
        return Err(DescriptorError::Empty);
    }
    assert!(
        out.src.len() >= n && out.dst.len() >= n && out.size.len() >= n,
        "slab too small"
    );
    let mut pass = Pass {
        input: batch,
        regions,
        coalesce,
        kinds: (direction.src_kind(), direction.dst_kind()),
        hints: (usize::MAX, usize::MAX),
        run_regions: (usize::MAX, usize::MAX),
        w: 0,
        bytes: 0,
        bits: 0,
        max_size: 0,
        unsorted: false,
    };
    // The first descriptor's regions seed the hints (a bad one is named by the exact pass).
    if let (Some(_), Some(_)) = (src[0].checked_add(size[0]), dst[0].checked_add(size[0])) {
        regions.locate(src[0], size[0], pass.kinds.0, &mut pass.hints.0);
        regions.locate(dst[0], size[0], pass.kinds.1, &mut pass.hints.1);
    }
    let mut start = 0;
    while start < n {
        let end = n.min(start + BLOCK);
        if !pass.fast_block(start..end, &mut out) {
            pass.exact_block(start..end, &mut out)?;
        }
        start = end;
    }
    let w = pass.w;
    if pass.unsorted {
        check_disjoint(&out.dst[..w], &out.size[..w], scratch)?;
    }
    Ok(Prepared {
        len: w,
        // Wrapping: destinations that add up past 2^64 bytes must overlap, and the overlap check
        // has refused them (disjoint ranges of the address space always fit in a u64).
        bytes: pass.bytes,
        max_size: pass.max_size,
        alignment: 1u64 << pass.bits.trailing_zeros().min(4),
        staged_rows: 0,
        staged_blocks_at: 0,
        staged_blocks: 0,
    })
}

/// Descriptors per block of [`prepare_into`]: long enough that the fast pass runs as a tight
/// loop, short enough that one descriptor in another region sends few others to the exact pass.
pub const BLOCK: usize = 64;

/// A caller's three columns: descriptor `i` copies `size[i]` bytes from `src[i]` to `dst[i]`.
#[derive(Clone, Copy, Debug)]
pub struct Batch<'a> {
    pub src: &'a [u64],
    pub dst: &'a [u64],
    pub size: &'a [u64],
}

/// The state of [`prepare_into`] between blocks.
struct Pass<'a> {
    input: Batch<'a>,
    regions: &'a RegionTable,
    coalesce: bool,
    kinds: (MemoryKind, MemoryKind),
    /// Regions (indices into the table) of the last descriptor located: sources, destinations.
    hints: (usize, usize),
    /// Regions of the run last written, `out[w - 1]`.
    run_regions: (usize, usize),
    /// Runs written.
    w: usize,
    bytes: u64,
    /// OR of every address and size: its trailing zeros give the alignment.
    bits: u64,
    max_size: u64,
    /// Some destination starts before its predecessor ends. Over the caller's descriptors this
    /// is the same as over the coalesced runs: a merged descriptor starts exactly where its
    /// predecessor ends, and a run ends where its last descriptor does.
    unsorted: bool,
}

impl Pass<'_> {
    /// Checks `range` in one branch-free pass and copies it out, when every descriptor is valid
    /// and lies in the hinted regions and (with `coalesce`) none continues its predecessor.
    /// Returns false, having changed nothing, otherwise.
    #[inline]
    fn fast_block(&mut self, range: std::ops::Range<usize>, out: &mut Columns<'_>) -> bool {
        let (input, coalesce) = (self.input, self.coalesce);
        let table = self.regions.regions();
        let (Some(rs), Some(rd)) = (table.get(self.hints.0), table.get(self.hints.1)) else {
            return false;
        };
        // `locate` sets a hint only to a region of the kind it was asked for.
        debug_assert_eq!((rs.kind, rd.kind), self.kinds);
        // Where the previous descriptor ends (it was checked). Before the first, 0: it follows
        // nothing, and continuing address 0 only sends the block to the exact pass.
        let (mut prev_s, mut prev_d) = match range.start.checked_sub(1) {
            Some(p) => (input.src[p] + input.size[p], input.dst[p] + input.size[p]),
            None => (0, 0),
        };
        let (s, d, z) = (
            &input.src[range.clone()],
            &input.dst[range.clone()],
            &input.size[range],
        );
        let (s_start, s_len) = (rs.start, rs.end - rs.start);
        let (d_start, d_len) = (rd.start, rd.end - rd.start);
        // Any reason to leave the block to the exact pass, and destinations out of order.
        let (mut bail, mut unsorted) = (false, false);
        let (mut bytes, mut bits, mut max_size) = (0u64, 0u64, 0u64);
        for ((&si, &di), &zi) in s.iter().zip(d).zip(z) {
            let (os, od) = (si.wrapping_sub(s_start), di.wrapping_sub(d_start));
            // Non-bitwise `|` on bools: no branch per condition. In its region, a range's offset
            // is at most the region's length and its size at most what is left after the
            // offset (so `address + size` cannot overflow either).
            bail |= (zi.wrapping_sub(1) >= i64::MAX as u64)
                || (os > s_len) | (zi > s_len.wrapping_sub(os))
                || (od > d_len) | (zi > d_len.wrapping_sub(od))
                || (coalesce && (si == prev_s) && (di == prev_d));
            unsorted |= di < prev_d;
            (prev_s, prev_d) = (si.wrapping_add(zi), di.wrapping_add(zi));
            bytes = bytes.wrapping_add(zi);
            bits |= si | di | zi;
            max_size = max_size.max(zi);
        }
        if bail {
            return false;
        }
        let (w, len) = (self.w, s.len());
        out.src[w..w + len].copy_from_slice(s);
        out.dst[w..w + len].copy_from_slice(d);
        out.size[w..w + len].copy_from_slice(z);
        self.w += len;
        self.run_regions = self.hints;
        self.bytes = self.bytes.wrapping_add(bytes);
        self.bits |= bits;
        self.max_size = self.max_size.max(max_size);
        self.unsorted |= unsorted;
        true
    }

    /// Checks `range` descriptor by descriptor, merges continuing ones, and writes the runs out.
    fn exact_block(
        &mut self,
        range: std::ops::Range<usize>,
        out: &mut Columns<'_>,
    ) -> Result<(), DescriptorError> {
        let (input, regions, coalesce) = (self.input, self.regions, self.coalesce);
        let (src_kind, dst_kind) = self.kinds;
        for i in range {
            let (s, d, z) = (input.src[i], input.dst[i], input.size[i]);
            if z == 0 {
                return Err(DescriptorError::ZeroSize { index: i });
            }
            if z > i64::MAX as u64 {
                return Err(DescriptorError::NegativeSize {
                    index: i,
                    value: z as i64,
                });
            }
            if s.checked_add(z).is_none() {
                return Err(DescriptorError::AddressOverflow {
                    index: i,
                    side: Side::Src,
                    addr: s,
                    size: z,
                });
            }
            if d.checked_add(z).is_none() {
                return Err(DescriptorError::AddressOverflow {
                    index: i,
                    side: Side::Dst,
                    addr: d,
                    size: z,
                });
            }
            let rs = regions.locate(s, z, src_kind, &mut self.hints.0).ok_or(
                DescriptorError::OutOfRegion {
                    index: i,
                    side: Side::Src,
                    addr: s,
                    size: z,
                    kind: src_kind,
                },
            )?;
            let rd = regions.locate(d, z, dst_kind, &mut self.hints.1).ok_or(
                DescriptorError::OutOfRegion {
                    index: i,
                    side: Side::Dst,
                    addr: d,
                    size: z,
                    kind: dst_kind,
                },
            )?;
            self.bytes = self.bytes.wrapping_add(z);
            self.bits |= s | d | z;
            if let Some(p) = i.checked_sub(1) {
                self.unsorted |= d < input.dst[p] + input.size[p];
            }
            let w = self.w;
            if coalesce
                && w > 0
                && (rs, rd) == self.run_regions
                && out.src[w - 1] + out.size[w - 1] == s
                && out.dst[w - 1] + out.size[w - 1] == d
            {
                // Within one region, so the run's size stays below the region's.
                out.size[w - 1] += z;
                self.max_size = self.max_size.max(out.size[w - 1]);
                continue;
            }
            (out.src[w], out.dst[w], out.size[w]) = (s, d, z);
            self.w += 1;
            self.run_regions = (rs, rd);
            self.max_size = self.max_size.max(z);
        }
        Ok(())
    }
}

/// Reusable buffers of the overlap check, kept by the caller so steady state allocates nothing.
#[derive(Debug, Default)]
pub struct Scratch {
    keys: Vec<u64>,
    /// A bit per slot (pages strategy of the overlap check) or per bucket (bucket strategy, with
    /// `at`: the index of the range starting in that bucket).
    taken: Vec<u64>,
    at: Vec<u32>,
    pub(crate) pairs: Vec<(u64, u64)>,
    /// Host rows `(address, bytes)` of one cluster of the cell plan (see `table::finish_cells`).
    pub(crate) rows: Vec<(u64, u64)>,
    /// Continuation flags of block-id transfers (see `table::expand_into`).
    pub(crate) merge: Vec<bool>,
    /// Bitset of the destination-uniqueness check of block-id transfers, kept clear between
    /// transfers (see `table::expand_into`).
    pub(crate) bits: Vec<u64>,
}

/// Moves the descriptors smaller than `below` to the front of `cols[..len]` (order within a
/// batch carries no meaning: its copies may run in any order). Returns how many there are, their
/// largest size and their common alignment (largest power of two up to 16 dividing every address
/// and size).
#[must_use]
pub fn partition_small(cols: Columns<'_>, len: usize, below: u64) -> (usize, u64, u64) {
    let Columns { src, dst, size } = cols;
    let mut k = 0;
    let (mut max_size, mut bits) = (0u64, 0u64);
    for i in 0..len {
        if size[i] < below {
            max_size = max_size.max(size[i]);
            bits |= src[i] | dst[i] | size[i];
            src.swap(i, k);
            dst.swap(i, k);
            size.swap(i, k);
            k += 1;
        }
    }
    (k, max_size, 1u64 << bits.trailing_zeros().min(4))
}

#[cfg(test)]
mod tests;
