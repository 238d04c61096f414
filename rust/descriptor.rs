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
#[allow(clippy::too_many_arguments)]
pub fn prepare_into(
    src: &[u64],
    dst: &[u64],
    size: &[u64],
    direction: Direction,
    regions: &RegionTable,
    coalesce: bool,
    mut out: Columns<'_>,
    scratch: &mut Scratch,
) -> Result<Prepared, DescriptorError> {
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
        input: Batch { src, dst, size },
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
    })
}

/// Descriptors per block of [`prepare_into`]: long enough that the fast pass runs as a tight
/// loop, short enough that one descriptor in another region sends few others to the exact pass.
pub const BLOCK: usize = 64;

/// A caller's three columns.
#[derive(Clone, Copy)]
struct Batch<'a> {
    src: &'a [u64],
    dst: &'a [u64],
    size: &'a [u64],
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
            bail |= (zi.wrapping_sub(1) >= i64::MAX as u64) // zero, or negative as i64
                | (os > s_len)
                | (zi > s_len.wrapping_sub(os))
                | (od > d_len)
                | (zi > d_len.wrapping_sub(od))
                | (coalesce & (si == prev_s) & (di == prev_d));
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
    /// Continuation flags of block-id transfers (see `table::expand_into`).
    pub(crate) merge: Vec<bool>,
}

/// Moves the descriptors smaller than `below` to the front of `cols[..len]` (order within a
/// batch carries no meaning: its copies may run in any order). Returns how many there are, their
/// largest size and their common alignment (largest power of two up to 16 dividing every address
/// and size).
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

/// Proves that the ranges `[dst[i], dst[i] + size[i])` are pairwise disjoint.
///
/// Four strategies, cheapest first:
///
/// * **Pages**: where every range has the same size `p` and starts a whole number of `p` from
///   the lowest, the ranges are slots of a pool, and they are disjoint exactly when no slot is
///   taken twice: one bit per slot, no ordering at all. Used when the span holds at most
///   [`SLOTS_PER_RANGE`] slots per range, which covers a transfer of pages scattered over a
///   pool a few hundred times its size (what a KV cache and the benchmarks move).
/// * **Buckets** (a counting sort). With `w` the largest power of two not above the smallest
///   size, two ranges starting in the same `w`-wide bucket overlap (the first is at least `w`
///   long). So the ranges are placed by bucket; a bucket taken twice is an overlap, and otherwise
///   the taken buckets list the ranges in address order, each of which must end where or before
///   the next begins. Linear in `n` plus the buckets, used when the span holds at most
///   [`BUCKETS_PER_RANGE`] buckets per range: blocks scattered over a pool a few times the
///   transfer, the common case of a KV cache. For 10,000 shuffled pages out of 20,000 it takes
///   47 us where the packed-key sort took 149 us (`cargo bench --bench submit`, development
///   machine).
/// * **Packed keys**: where the destinations span less than 2^40 bytes and there are fewer than
///   2^24 of them, each range is packed into one `u64` key (offset from the lowest destination,
///   then its index), and the keys are put in order by a counting sort on their top bits into
///   about one bucket per key, then a sort of each bucket (see [`radix_keys`]): linear for pages
///   scattered over a pool many times the batch, where the bucket strategy does not apply. For
///   10,000 pages out of a pool of 1,000,000 the whole `prepare` took 168 us where sorting all
///   the keys at once took 230 us (`cargo bench --bench submit`, "sparse shuffled dst",
///   development machine).
/// * **Pairs** sorted by address otherwise.
///
/// Each range must be non-empty and `dst[i] + size[i]` must not overflow (what [`prepare_into`]
/// has checked before it calls this). Fewer than two ranges are disjoint.
pub fn check_disjoint(
    dst: &[u64],
    size: &[u64],
    scratch: &mut Scratch,
) -> Result<(), DescriptorError> {
    const INDEX_BITS: u32 = 24;
    assert_eq!(dst.len(), size.len(), "one size per destination");
    if dst.len() < 2 {
        // Nothing to compare (and no lowest destination to measure the span from).
        return Ok(());
    }
    let (lo, hi) = dst
        .iter()
        .fold((u64::MAX, 0), |(lo, hi), &d| (lo.min(d), hi.max(d)));
    let (min_size, max_size) = size
        .iter()
        .fold((u64::MAX, 0), |(lo, hi), &z| (lo.min(z), hi.max(z)));
    if min_size == max_size && check_disjoint_pages(dst, min_size, lo, hi, &mut scratch.taken) {
        return Ok(());
    }
    if let Some(done) = check_disjoint_buckets(dst, size, lo, hi, min_size, scratch) {
        return done;
    }
    if dst.len() < (1 << INDEX_BITS) && hi - lo < (1 << (64 - INDEX_BITS)) {
        let keys = &mut scratch.keys;
        radix_keys(dst, lo, hi, INDEX_BITS, keys, &mut scratch.at);
        let mask = (1u64 << INDEX_BITS) - 1;
        return keys.windows(2).try_for_each(|w| {
            let (i, j) = ((w[0] & mask) as usize, (w[1] & mask) as usize);
            if dst[i] + size[i] > dst[j] {
                Err(DescriptorError::OverlappingDestinations {
                    first: (dst[i], size[i]),
                    second: (dst[j], size[j]),
                })
            } else {
                Ok(())
            }
        });
    }
    let pairs = &mut scratch.pairs;
    pairs.clear();
    pairs.extend(dst.iter().zip(size).map(|(&d, &z)| (d, z)));
    pairs.sort_unstable_by_key(|&(d, _)| d);
    for pair in pairs.windows(2) {
        let ((d0, z0), (d1, z1)) = (pair[0], pair[1]);
        if d0 + z0 > d1 {
            return Err(DescriptorError::OverlappingDestinations {
                first: (d0, z0),
                second: (d1, z1),
            });
        }
    }
    Ok(())
}

/// Most slots per range the pages strategy of [`check_disjoint`] takes on: a bit each, cleared
/// and then set at random, so 512 slots cost 64 bytes of bitmap per range.
pub const SLOTS_PER_RANGE: u64 = 512;

/// Most slots at all (4 MiB of bitmap), whatever the number of ranges.
const MAX_SLOTS: u64 = 1 << 25;

/// The pages strategy of [`check_disjoint`]: true where every `dst[i]` is `lo` plus a whole
/// number of `page` bytes, and no two are the same, which proves ranges of `page` bytes each
/// disjoint. False where that does not hold (a range off the slot grid, or two on one slot: the
/// caller's other strategies then find the overlapping pair) or the span holds too many slots.
///
/// The slot of `x = d - lo` with `page = 2^k * m`, `m` odd: `x` must have its low `k` bits
/// clear, and `(x >> k) * m^-1 mod 2^64` is then `x / page` if `m` divides `x >> k`, and above
/// `(2^64 - 1) / m` (so above any slot) if it does not (Granlund and Montgomery's test of
/// divisibility by multiplication): one multiply per range, no division.
fn check_disjoint_pages(dst: &[u64], page: u64, lo: u64, hi: u64, taken: &mut Vec<u64>) -> bool {
    if page == 0 {
        return false; // not a range (`check_disjoint` is not asked about empty ones)
    }
    let slots = (hi - lo) / page + 1;
    if slots > SLOTS_PER_RANGE * dst.len() as u64 || slots > MAX_SLOTS {
        return false;
    }
    let k = page.trailing_zeros();
    let low = (1u64 << k) - 1;
    let odd = page >> k;
    // The inverse of `odd` modulo 2^64 by Newton's iteration: correct to 3 bits at the start
    // (odd * odd = 1 mod 8), each step doubles that: 6, 12, 24, 48, 96.
    let mut inverse = odd;
    for _ in 0..5 {
        inverse = inverse.wrapping_mul(2u64.wrapping_sub(odd.wrapping_mul(inverse)));
    }
    debug_assert_eq!(odd.wrapping_mul(inverse), 1);
    taken.clear();
    taken.resize((slots as usize).div_ceil(64), 0);
    for &d in dst {
        let x = d - lo;
        let slot = (x >> k).wrapping_mul(inverse);
        if x & low != 0 || slot >= slots {
            return false;
        }
        let (word, bit) = ((slot / 64) as usize, 1u64 << (slot % 64));
        if taken[word] & bit != 0 {
            return false;
        }
        taken[word] |= bit;
    }
    true
}

/// Fills `keys` with one key per destination, `(dst[i] - lo) << index_bits | i`, in ascending
/// order. `hi - lo` must fit in `64 - index_bits` bits and `dst.len()` in `index_bits`.
///
/// A counting sort on the keys' top bits into about one bucket per key (`counts`: their
/// boundaries), then each bucket sorted on its own: linear in `n` for scattered destinations,
/// whatever span they cover, and no worse than one sort where they cluster into few buckets.
fn radix_keys(
    dst: &[u64],
    lo: u64,
    hi: u64,
    index_bits: u32,
    keys: &mut Vec<u64>,
    counts: &mut Vec<u32>,
) {
    let n = dst.len();
    let bucket_bits = n
        .next_power_of_two()
        .trailing_zeros()
        .min(MAX_BUCKETS.trailing_zeros());
    let shift = (64 - (hi - lo).leading_zeros()).saturating_sub(bucket_bits);
    let buckets = (((hi - lo) >> shift) + 1) as usize;
    counts.clear();
    counts.resize(buckets + 1, 0);
    for &d in dst {
        counts[((d - lo) >> shift) as usize + 1] += 1;
    }
    // counts[b] becomes the first slot of bucket b.
    for b in 1..=buckets {
        counts[b] += counts[b - 1];
    }
    keys.clear();
    keys.resize(n, 0);
    for (i, &d) in dst.iter().enumerate() {
        let b = ((d - lo) >> shift) as usize;
        keys[counts[b] as usize] = ((d - lo) << index_bits) | i as u64;
        counts[b] += 1;
    }
    // Now counts[b] is the end of bucket b, and the start of bucket b + 1.
    let mut start = 0;
    for &end in &counts[..buckets] {
        let end = end as usize;
        if end - start > 1 {
            keys[start..end].sort_unstable();
        }
        start = end;
    }
}

/// Most buckets per range the bucket strategy of [`check_disjoint`] takes on. It clears and scans
/// a bit per bucket and writes a `u32` only where a range starts: at 16 buckets per range that is
/// 2 bytes of bitmap per range, well below what sorting the range costs.
pub const BUCKETS_PER_RANGE: u64 = 16;

/// Most buckets at all (16 MiB of `u32`s), whatever the number of ranges.
const MAX_BUCKETS: u64 = 1 << 22;

/// The bucket strategy of [`check_disjoint`]; `None` where the span holds too many buckets.
fn check_disjoint_buckets(
    dst: &[u64],
    size: &[u64],
    lo: u64,
    hi: u64,
    min_size: u64,
    scratch: &mut Scratch,
) -> Option<Result<(), DescriptorError>> {
    let n = dst.len() as u64;
    if n > u32::MAX as u64 || min_size == 0 {
        return None;
    }
    // w = 2^shift <= min_size: starts less than w apart overlap.
    let shift = 63 - min_size.leading_zeros();
    let buckets = ((hi - lo) >> shift) + 1;
    if buckets > BUCKETS_PER_RANGE * n || buckets > MAX_BUCKETS {
        return None;
    }
    let buckets = buckets as usize;
    let words = buckets.div_ceil(64);
    let taken = &mut scratch.taken;
    taken.clear();
    taken.resize(words, 0);
    let at = &mut scratch.at;
    if at.len() < buckets {
        // Entries are read only where `taken` says a range was placed: no need to clear them.
        at.resize(buckets, 0);
    }
    for (i, &d) in dst.iter().enumerate() {
        let b = ((d - lo) >> shift) as usize;
        let (word, bit) = (b / 64, 1u64 << (b % 64));
        if taken[word] & bit != 0 {
            let j = at[b] as usize;
            let (a, c) = if dst[j] <= d { (j, i) } else { (i, j) };
            return Some(Err(DescriptorError::OverlappingDestinations {
                first: (dst[a], size[a]),
                second: (dst[c], size[c]),
            }));
        }
        taken[word] |= bit;
        at[b] = i as u32;
    }
    // The taken buckets in order are the ranges in address order.
    let mut prev: Option<usize> = None;
    for (word, &bits) in taken.iter().enumerate() {
        let mut bits = bits;
        while bits != 0 {
            let b = word * 64 + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            let j = at[b] as usize;
            if let Some(i) = prev {
                if dst[i] + size[i] > dst[j] {
                    return Some(Err(DescriptorError::OverlappingDestinations {
                        first: (dst[i], size[i]),
                        second: (dst[j], size[j]),
                    }));
                }
            }
            prev = Some(j);
        }
    }
    Some(Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> RegionTable {
        let mut t = RegionTable::default();
        t.insert(0x1000, 0x10_0000, MemoryKind::Host).unwrap();
        t.insert(0x1000_0000, 0x10_0000, MemoryKind::Device)
            .unwrap();
        t
    }

    type Triple = (u64, u64, u64);

    fn run(
        src: &[u64],
        dst: &[u64],
        size: &[u64],
        coalesce: bool,
    ) -> Result<(Prepared, Vec<Triple>), DescriptorError> {
        let n = src.len().max(1);
        let (mut s, mut d, mut z) = (vec![0; n], vec![0; n], vec![0; n]);
        let p = prepare_into(
            src,
            dst,
            size,
            Direction::HostToDevice,
            &table(),
            coalesce,
            Columns {
                src: &mut s,
                dst: &mut d,
                size: &mut z,
            },
            &mut Scratch::default(),
        )?;
        Ok((p, (0..p.len).map(|i| (s[i], d[i], z[i])).collect()))
    }

    #[test]
    fn no_or_one_range_is_disjoint() {
        // Found by the `disjoint` fuzz target: an empty batch underflowed the span computation.
        let mut scratch = Scratch::default();
        assert_eq!(check_disjoint(&[], &[], &mut scratch), Ok(()));
        assert_eq!(check_disjoint(&[u64::MAX - 1], &[1], &mut scratch), Ok(()));
    }

    #[test]
    fn huge_overlapping_destinations_are_refused_not_summed_past_u64() {
        // Found by the `prepare` fuzz target: sizes near 2^62 into one destination overflowed the
        // byte count (a panic with overflow checks) before the overlap check could refuse them.
        let mut t = RegionTable::default();
        t.insert(0, 1 << 63, MemoryKind::Host).unwrap();
        t.insert(1 << 63, (1 << 63) - 1, MemoryKind::Device)
            .unwrap();
        let (mut s, mut d, mut z) = (vec![0; 5], vec![0; 5], vec![0; 5]);
        let got = prepare_into(
            &[0; 5],
            &[1 << 63; 5],
            &[1 << 62; 5],
            Direction::HostToDevice,
            &t,
            true,
            Columns {
                src: &mut s,
                dst: &mut d,
                size: &mut z,
            },
            &mut Scratch::default(),
        );
        assert!(matches!(
            got,
            Err(DescriptorError::OverlappingDestinations { .. })
        ));
    }

    #[test]
    fn sixteen_contiguous_blocks_become_one() {
        let src: Vec<u64> = (0..16).map(|i| 0x1000 + i * 8192).collect();
        let dst: Vec<u64> = (0..16).map(|i| 0x1000_0000 + i * 8192).collect();
        let (p, out) = run(&src, &dst, &[8192; 16], true).unwrap();
        assert_eq!(out, vec![(0x1000, 0x1000_0000, 128 * 1024)]);
        assert_eq!(p.bytes, 128 * 1024);
        assert_eq!(p.max_size, 128 * 1024);
    }

    #[test]
    fn never_merges_across_a_gap() {
        // Source continues, destination has a gap.
        let (p, _) = run(
            &[0x1000, 0x1100],
            &[0x1000_0000, 0x1000_0200],
            &[0x100, 0x100],
            true,
        )
        .unwrap();
        assert_eq!(p.len, 2);
        // Destination continues, source has a gap.
        let (p, _) = run(
            &[0x1000, 0x1200],
            &[0x1000_0000, 0x1000_0100],
            &[0x100, 0x100],
            true,
        )
        .unwrap();
        assert_eq!(p.len, 2);
        // Without coalescing nothing merges.
        let (p, _) = run(
            &[0x1000, 0x1100],
            &[0x1000_0000, 0x1000_0100],
            &[0x100, 0x100],
            false,
        )
        .unwrap();
        assert_eq!(p.len, 2);
    }

    #[test]
    fn rejects_bad_descriptors_with_their_index() {
        assert_eq!(
            run(&[0x1000, 0x2000], &[0x1000_0000], &[1, 1], true).unwrap_err(),
            DescriptorError::LengthMismatch {
                src: 2,
                dst: 1,
                size: 2
            }
        );
        assert_eq!(
            run(&[], &[], &[], true).unwrap_err(),
            DescriptorError::Empty
        );
        assert_eq!(
            run(
                &[0x1000, 0x2000],
                &[0x1000_0000, 0x1000_1000],
                &[8, 0],
                true
            )
            .unwrap_err(),
            DescriptorError::ZeroSize { index: 1 }
        );
        assert_eq!(
            run(&[0x1000], &[0x1000_0000], &[(-5i64) as u64], true).unwrap_err(),
            DescriptorError::NegativeSize {
                index: 0,
                value: -5
            }
        );
        assert!(matches!(
            run(&[u64::MAX - 2], &[0x1000_0000], &[8], true).unwrap_err(),
            DescriptorError::AddressOverflow {
                index: 0,
                side: Side::Src,
                ..
            }
        ));
        assert!(matches!(
            run(&[0x1000], &[0x1000_0000 + 0x10_0000 - 4], &[8], true).unwrap_err(),
            DescriptorError::OutOfRegion {
                index: 0,
                side: Side::Dst,
                ..
            }
        ));
        // A device address where a host one belongs.
        assert!(matches!(
            run(&[0x1000_0000], &[0x1000_0000], &[8], true).unwrap_err(),
            DescriptorError::OutOfRegion {
                index: 0,
                side: Side::Src,
                kind: MemoryKind::Host,
                ..
            }
        ));
    }

    #[test]
    fn rejects_overlapping_destinations_in_any_order() {
        // Ascending but overlapping.
        assert!(matches!(
            run(
                &[0x1000, 0x2000],
                &[0x1000_0000, 0x1000_0004],
                &[8, 8],
                true
            )
            .unwrap_err(),
            DescriptorError::OverlappingDestinations { .. }
        ));
        // Descending order takes the sorting path.
        assert!(matches!(
            run(
                &[0x1000, 0x2000, 0x3000],
                &[0x1000_0100, 0x1000_0000, 0x1000_00f8],
                &[8, 8, 16],
                true
            )
            .unwrap_err(),
            DescriptorError::OverlappingDestinations { .. }
        ));
        // Descending and disjoint is fine.
        run(
            &[0x1000, 0x2000],
            &[0x1000_0100, 0x1000_0000],
            &[8, 8],
            true,
        )
        .unwrap();
    }

    #[test]
    fn partition_moves_small_descriptors_first() {
        let mut s = vec![0x100, 0x200, 0x300, 0x400];
        let mut d = vec![0x1000, 0x2000, 0x3000, 0x4000];
        let mut z = vec![64, 4096, 8, 1 << 20];
        let (k, max, align) = partition_small(
            Columns {
                src: &mut s,
                dst: &mut d,
                size: &mut z,
            },
            4,
            4096,
        );
        assert_eq!((k, max, align), (2, 64, 8));
        let mut small: Vec<_> = (0..k).map(|i| (s[i], d[i], z[i])).collect();
        small.sort();
        assert_eq!(small, vec![(0x100, 0x1000, 64), (0x300, 0x3000, 8)]);
        let mut large: Vec<_> = (k..4).map(|i| (s[i], d[i], z[i])).collect();
        large.sort();
        assert_eq!(large, vec![(0x200, 0x2000, 4096), (0x400, 0x4000, 1 << 20)]);
    }

    #[test]
    fn alignment_is_the_common_power_of_two() {
        let (p, _) = run(&[0x1000], &[0x1000_0000], &[4096], true).unwrap();
        assert_eq!(p.alignment, 16);
        let (p, _) = run(&[0x1004], &[0x1000_0000], &[4096], true).unwrap();
        assert_eq!(p.alignment, 4);
        let (p, _) = run(&[0x1000], &[0x1000_0000], &[4097], true).unwrap();
        assert_eq!(p.alignment, 1);
    }
}

#[cfg(test)]
mod fuzz {
    //! Arbitrary batches through `prepare_into`: it never panics, and whatever it accepts is a
    //! faithful, safe rewrite of the input.
    use super::*;
    use proptest::prelude::*;

    const HOST: u64 = 0x10_000;
    const DEV: u64 = 0x90_000;
    const LEN: u64 = 0x8_000;

    fn addr() -> impl Strategy<Value = u64> {
        prop_oneof![
            4 => (0..LEN + 64).prop_map(|o| HOST + o),
            4 => (0..LEN + 64).prop_map(|o| DEV + o),
            1 => any::<u64>(),
            1 => Just(u64::MAX - 3),
        ]
    }

    fn size() -> impl Strategy<Value = u64> {
        prop_oneof![8 => 1u64..512, 1 => Just(0u64), 1 => any::<u64>()]
    }

    fn batch() -> impl Strategy<Value = (Vec<u64>, Vec<u64>, Vec<u64>)> {
        (1usize..48).prop_flat_map(|n| {
            (
                prop::collection::vec(addr(), n),
                prop::collection::vec(addr(), n),
                prop::collection::vec(size(), n),
            )
        })
    }

    /// Runs of contiguous blocks (so coalescing has work) laid out without destination overlap.
    fn contiguous() -> impl Strategy<Value = (Vec<u64>, Vec<u64>, Vec<u64>)> {
        prop::collection::vec((0u64..LEN / 2, 1usize..6, 1u64..64, any::<bool>()), 1..12).prop_map(
            |runs| {
                let (mut s, mut d, mut z) = (vec![], vec![], vec![]);
                let mut next = 0u64;
                for (off, count, blk, gap) in runs {
                    for k in 0..count as u64 {
                        if next + blk > LEN {
                            break;
                        }
                        s.push(HOST + (off + k * blk) % (LEN - blk));
                        d.push(DEV + next);
                        z.push(blk);
                        next += blk;
                    }
                    next += gap as u64;
                }
                if s.is_empty() {
                    (vec![HOST], vec![DEV], vec![1])
                } else {
                    (s, d, z)
                }
            },
        )
    }

    fn regions() -> RegionTable {
        let mut t = RegionTable::default();
        t.insert(HOST, LEN, MemoryKind::Host).unwrap();
        t.insert(DEV, LEN, MemoryKind::Device).unwrap();
        t
    }

    /// Per destination byte, the source byte it receives.
    fn byte_map(s: &[u64], d: &[u64], z: &[u64]) -> std::collections::BTreeMap<u64, u64> {
        let mut m = std::collections::BTreeMap::new();
        for i in 0..s.len() {
            for k in 0..z[i] {
                m.insert(d[i] + k, s[i] + k);
            }
        }
        m
    }

    fn check(s: &[u64], d: &[u64], z: &[u64], coalesce: bool) -> Result<(), TestCaseError> {
        let n = s.len();
        let (mut os, mut od, mut oz) = (vec![0; n], vec![0; n], vec![0; n]);
        let t = regions();
        let r = prepare_into(
            s,
            d,
            z,
            Direction::HostToDevice,
            &t,
            coalesce,
            Columns {
                src: &mut os,
                dst: &mut od,
                size: &mut oz,
            },
            &mut Scratch::default(),
        );
        if let Ok(p) = r {
            prop_assert!(p.len <= n);
            prop_assert_eq!(p.bytes, z.iter().sum::<u64>());
            let mut hint = usize::MAX;
            for i in 0..p.len {
                prop_assert!(t
                    .locate(os[i], oz[i], MemoryKind::Host, &mut hint)
                    .is_some());
                prop_assert!(t
                    .locate(od[i], oz[i], MemoryKind::Device, &mut hint)
                    .is_some());
            }
            // Destinations disjoint, and every destination byte gets the same source byte.
            let mut ranges: Vec<_> = (0..p.len).map(|i| (od[i], oz[i])).collect();
            ranges.sort();
            prop_assert!(ranges.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0));
            prop_assert_eq!(
                byte_map(&os[..p.len], &od[..p.len], &oz[..p.len]),
                byte_map(s, d, z)
            );
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 2 } else { 512 }))]

        #[test]
        fn arbitrary_batches_never_panic_and_stay_faithful((s, d, z) in batch(), coalesce: bool) {
            check(&s, &d, &z, coalesce)?;
        }

        #[test]
        fn contiguous_runs_coalesce_faithfully((s, d, z) in contiguous()) {
            check(&s, &d, &z, true)?;
            let n = s.len();
            let (mut os, mut od, mut oz) = (vec![0; n], vec![0; n], vec![0; n]);
            let p = prepare_into(&s, &d, &z, Direction::HostToDevice, &regions(), true,
                Columns { src: &mut os, dst: &mut od, size: &mut oz }, &mut Scratch::default()).unwrap();
            // No two consecutive outputs could have been merged: coalescing is maximal.
            for i in 1..p.len {
                prop_assert!(!(os[i - 1] + oz[i - 1] == os[i] && od[i - 1] + oz[i - 1] == od[i]));
            }
        }
    }
}

#[cfg(test)]
mod blocks {
    //! `prepare_into` (fast pass per block, exact pass where needed) against a reference that
    //! checks every descriptor on its own: the same result, error included, for long batches
    //! over several adjacent regions, with runs to merge and a few bad descriptors anywhere.
    use super::*;
    use proptest::prelude::*;

    const HOST: u64 = 0x10_000;
    const DEV: u64 = 0x90_000;
    /// Each side has two adjacent regions of `LEN` bytes: blocks that cross from one to the
    /// other are refused, neighbours across the boundary are valid but never merge.
    const LEN: u64 = 0x8_000;

    fn table() -> RegionTable {
        let mut t = RegionTable::default();
        for base in [HOST, HOST + LEN] {
            t.insert(base, LEN, MemoryKind::Host).unwrap();
        }
        for base in [DEV, DEV + LEN] {
            t.insert(base, LEN, MemoryKind::Device).unwrap();
        }
        t
    }

    type Runs = Vec<(u64, u64, u64)>;

    /// One descriptor at a time, each located from scratch; then always the overlap check.
    fn reference(
        s: &[u64],
        d: &[u64],
        z: &[u64],
        coalesce: bool,
    ) -> Result<(Prepared, Runs), DescriptorError> {
        let t = table();
        let mut runs: Vec<(u64, u64, u64, usize, usize)> = vec![];
        let (mut bytes, mut bits) = (0u64, 0u64);
        for i in 0..s.len() {
            if z[i] == 0 {
                return Err(DescriptorError::ZeroSize { index: i });
            }
            if z[i] > i64::MAX as u64 {
                return Err(DescriptorError::NegativeSize {
                    index: i,
                    value: z[i] as i64,
                });
            }
            for (side, addr) in [(Side::Src, s[i]), (Side::Dst, d[i])] {
                if addr.checked_add(z[i]).is_none() {
                    return Err(DescriptorError::AddressOverflow {
                        index: i,
                        side,
                        addr,
                        size: z[i],
                    });
                }
            }
            let locate = |side, addr, kind| {
                let mut no_hint = usize::MAX;
                t.locate(addr, z[i], kind, &mut no_hint)
                    .ok_or(DescriptorError::OutOfRegion {
                        index: i,
                        side,
                        addr,
                        size: z[i],
                        kind,
                    })
            };
            let rs = locate(Side::Src, s[i], MemoryKind::Host)?;
            let rd = locate(Side::Dst, d[i], MemoryKind::Device)?;
            bytes = bytes.wrapping_add(z[i]);
            bits |= s[i] | d[i] | z[i];
            match runs.last_mut() {
                Some((ps, pd, pz, prs, prd))
                    if coalesce
                        && (*prs, *prd) == (rs, rd)
                        && *ps + *pz == s[i]
                        && *pd + *pz == d[i] =>
                {
                    *pz += z[i]
                }
                _ => runs.push((s[i], d[i], z[i], rs, rd)),
            }
        }
        let dst: Vec<u64> = runs.iter().map(|r| r.1).collect();
        let size: Vec<u64> = runs.iter().map(|r| r.2).collect();
        check_disjoint(&dst, &size, &mut Scratch::default())?;
        let prepared = Prepared {
            len: runs.len(),
            bytes,
            max_size: size.iter().copied().max().unwrap_or(0),
            alignment: 1 << bits.trailing_zeros().min(4),
            staged_rows: 0,
        };
        Ok((prepared, runs.iter().map(|r| (r.0, r.1, r.2)).collect()))
    }

    fn prepared(
        s: &[u64],
        d: &[u64],
        z: &[u64],
        coalesce: bool,
        scratch: &mut Scratch,
    ) -> Result<(Prepared, Runs), DescriptorError> {
        let n = s.len();
        let (mut os, mut od, mut oz) = (vec![0; n], vec![0; n], vec![0; n]);
        let cols = Columns {
            src: &mut os,
            dst: &mut od,
            size: &mut oz,
        };
        let p = prepare_into(
            s,
            d,
            z,
            Direction::HostToDevice,
            &table(),
            coalesce,
            cols,
            scratch,
        )?;
        Ok((p, (0..p.len).map(|i| (os[i], od[i], oz[i])).collect()))
    }

    /// Pages of one size, as a KV cache moves them: sources and destinations in one region on
    /// each side (destinations a shuffle of its slots, so disjoint until there are more pages
    /// than slots), now and then a page in the neighbouring region, some pages continuing their
    /// predecessor on both sides, and up to three faults.
    fn long_batch() -> impl Strategy<Value = (Vec<u64>, Vec<u64>, Vec<u64>)> {
        let rates = (
            prop::sample::select(vec![0.0, 0.005, 0.3]), // continues its predecessor
            prop::sample::select(vec![0.0, 0.01, 0.1]),  // lies in the other region
        );
        (
            prop::sample::select(vec![16u64, 48, 128]),
            1usize..300,
            rates,
        )
            .prop_flat_map(|(page, n, (cont, away))| {
                let slots = (LEN / page) as usize;
                (
                    Just(page),
                    prop::collection::vec((0..slots, prop::bool::weighted(away)), n),
                    Just((0..slots).collect::<Vec<_>>()).prop_shuffle(),
                    prop::collection::vec(
                        (prop::bool::weighted(away), prop::bool::weighted(cont)),
                        n,
                    ),
                    prop::collection::vec((any::<prop::sample::Index>(), 0u8..10), 0..3),
                )
            })
            .prop_map(|(page, src_slots, dst_slots, flags, faults)| {
                let n = src_slots.len();
                let (mut s, mut d, mut z) = (vec![0; n], vec![0; n], vec![page; n]);
                for i in 0..n {
                    let ((src_slot, src_away), (dst_away, continues)) = (src_slots[i], flags[i]);
                    let region = |away| if away { LEN } else { 0 };
                    (s[i], d[i]) = if continues && i > 0 {
                        (s[i - 1] + page, d[i - 1] + page)
                    } else {
                        (
                            HOST + region(src_away) + src_slot as u64 * page,
                            DEV + region(dst_away) + dst_slots[i % dst_slots.len()] as u64 * page,
                        )
                    };
                }
                for (at, fault) in faults {
                    let i = at.index(n);
                    match fault {
                        0 => z[i] = 0,
                        1 => z[i] = 1 << 63,
                        2 => s[i] = u64::MAX - 3,
                        3 => d[i] = u64::MAX - 3,
                        4 => s[i] = HOST - 8, // starts before every region
                        5 => d[i] = DEV + LEN - page / 2, // across the boundary of two regions
                        6 => d[i] = HOST,     // host memory as a destination
                        7 => z[i] = page - 1, // valid, and aligned to one byte
                        8 => s[i] = HOST + LEN - page / 2, // a source across two regions
                        _ => d[i] = d[(i + 1) % n], // two pages on one slot
                    }
                }
                (s, d, z)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 2 } else { 1024 }))]

        #[test]
        fn blocks_agree_with_one_descriptor_at_a_time((s, d, z) in long_batch(), coalesce: bool) {
            prop_assert_eq!(
                prepared(&s, &d, &z, coalesce, &mut Scratch::default()),
                reference(&s, &d, &z, coalesce)
            );
        }
    }

    #[test]
    fn a_bad_descriptor_after_many_fast_blocks_is_named() {
        let n = 20 * BLOCK + 7;
        let s: Vec<u64> = (0..n as u64)
            .map(|i| HOST + 16 * ((i * 7) % 1024))
            .collect();
        let d: Vec<u64> = (0..n as u64).map(|i| DEV + 16 * i).collect();
        let mut scratch = Scratch::default();
        let (p, runs) = prepared(&s, &d, &[16; 20 * BLOCK + 7], true, &mut scratch).unwrap();
        assert_eq!(
            (p.len, p.bytes, p.max_size, p.alignment),
            (n, 16 * n as u64, 16, 16)
        );
        assert_eq!(runs[n - 1], (s[n - 1], d[n - 1], 16));
        for (at, side) in [(BLOCK * 13 + 5, Side::Src), (n - 1, Side::Dst)] {
            let (mut s, mut d) = (s.clone(), d.clone());
            match side {
                Side::Src => s[at] = DEV,
                Side::Dst => d[at] = HOST + LEN - 8,
            }
            let addr = if side == Side::Src { s[at] } else { d[at] };
            let kind = if side == Side::Src {
                MemoryKind::Host
            } else {
                MemoryKind::Device
            };
            assert_eq!(
                prepared(&s, &d, &[16; 20 * BLOCK + 7], true, &mut scratch),
                Err(DescriptorError::OutOfRegion {
                    index: at,
                    side,
                    addr,
                    size: 16,
                    kind
                })
            );
        }
    }
}

#[cfg(test)]
mod disjoint {
    //! `check_disjoint` against a brute-force reference, over inputs shaped to land in each of its
    //! strategies, with one scratch reused across calls the way an engine reuses it.
    use super::*;
    use proptest::prelude::*;

    /// The first overlapping pair by address, by comparing every pair.
    fn reference(dst: &[u64], size: &[u64]) -> bool {
        (0..dst.len())
            .any(|i| (0..i).any(|j| dst[i] < dst[j] + size[j] && dst[j] < dst[i] + size[i]))
    }

    fn agree(dst: &[u64], size: &[u64], scratch: &mut Scratch) -> Result<(), TestCaseError> {
        match check_disjoint(dst, size, scratch) {
            Ok(()) => prop_assert!(!reference(dst, size), "accepted an overlap"),
            Err(DescriptorError::OverlappingDestinations { first, second }) => {
                prop_assert!(reference(dst, size), "refused disjoint ranges");
                // The pair named is one that overlaps, in address order, and is in the input.
                prop_assert!(first.0 <= second.0 && second.0 < first.0 + first.1);
                let has = |r: (u64, u64)| dst.iter().zip(size).any(|(&d, &z)| (d, z) == r);
                prop_assert!(has(first) && has(second));
            }
            Err(e) => prop_assert!(false, "unexpected error {e:?}"),
        }
        Ok(())
    }

    /// [`agree`] for each batch in turn, with one scratch: what one batch leaves in it must not
    /// change the answer for the next.
    fn agree_in_turn(batches: &[(&[u64], &[u64])]) -> Result<(), TestCaseError> {
        let mut scratch = Scratch::default();
        batches
            .iter()
            .try_for_each(|&(dst, size)| agree(dst, size, &mut scratch))
    }

    /// Pages of a pool: slots of `page` bytes out of `4 * n`, a few nudged off the grid or
    /// shortened, so some batches overlap. The bucket strategy's case.
    fn slotted() -> impl Strategy<Value = (Vec<u64>, Vec<u64>)> {
        (1u64..5000, 2usize..200).prop_flat_map(|(page, n)| {
            let slot = (0..4 * n as u64, 0u64..8, 0u64..4);
            proptest::collection::vec(slot, n).prop_map(move |v| pages(page, v))
        })
    }

    /// Ranges of `(slot, nudge, cut)`: page `slot`, moved half a page off the grid where `nudge`
    /// is 0 and a third shorter where `cut` is 0.
    fn pages(page: u64, slots: Vec<(u64, u64, u64)>) -> (Vec<u64>, Vec<u64>) {
        slots
            .into_iter()
            .map(|(s, nudge, cut)| {
                let d = 0x1000_0000 + s * page + if nudge == 0 { page / 2 } else { 0 };
                (d, if cut == 0 { page - page / 3 } else { page })
            })
            .unzip()
    }

    /// Pages spread over a pool 64 or 4,096 times the batch, half of them possibly in a cluster
    /// of neighbouring slots at its start (many keys to a bucket), a few nudged off the grid or
    /// shortened: the packed keys' counting sort, sparse buckets and crowded ones.
    fn sparse() -> impl Strategy<Value = (Vec<u64>, Vec<u64>)> {
        let spread = prop_oneof![Just(64u64), Just(4096)];
        (1u64..5000, 2usize..200, spread).prop_flat_map(|(page, n, spread)| {
            let wide = 0..spread * n as u64;
            let slot = (prop_oneof![wide, 0..n as u64 / 2 + 1], 0u64..16, 0u64..8);
            proptest::collection::vec(slot, n).prop_map(move |v| pages(page, v))
        })
    }

    /// Pages all of one size (odd, even, powers of two) on the slots of a pool 2, 64 or 600
    /// times the batch, from a base off any grid, a few of them moved off the slots by a byte or
    /// half a page; random slots, so some batches put two pages on one. The pages strategy.
    fn equal_pages() -> impl Strategy<Value = (Vec<u64>, Vec<u64>)> {
        let page = prop_oneof![1u64..5000, (0u32..22).prop_map(|k| 1u64 << k)];
        let spread = prop_oneof![Just(2u64), Just(64), Just(600)];
        (page, 2usize..200, spread, 0u64..1 << 20).prop_flat_map(|(page, n, spread, base)| {
            let slot = (
                0..spread * n as u64,
                prop_oneof![30 => Just(0u64), 1 => Just(1), 1 => Just(page / 2)],
            );
            proptest::collection::vec(slot, n).prop_map(move |v| {
                let dst = v
                    .iter()
                    .map(|&(s, off)| 0x1000_0000 + base + s * page + off)
                    .collect();
                (dst, vec![page; n])
            })
        })
    }

    /// Ranges of mixed sizes anywhere in a small span (packed keys) or the whole space (pairs).
    fn scattered() -> impl Strategy<Value = (Vec<u64>, Vec<u64>)> {
        let span = prop_oneof![Just(1u64 << 16), Just(1u64 << 50), Just(u64::MAX / 2)];
        (span, 2usize..100).prop_flat_map(|(span, n)| {
            proptest::collection::vec((0..span, 1u64..1 << 14), n)
                .prop_map(|v| v.into_iter().unzip())
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 2 } else { 1024 }))]

        #[test]
        fn slotted_pages_agree_with_the_reference((d, z) in slotted(), (d2, z2) in slotted()) {
            agree_in_turn(&[(&d, &z), (&d2, &z2)])?;
        }

        #[test]
        fn sparse_pages_agree_with_the_reference((d, z) in sparse(), (d2, z2) in slotted()) {
            agree_in_turn(&[(&d, &z), (&d2, &z2), (&d, &z)])?;
        }

        #[test]
        fn equal_pages_agree_with_the_reference(
            (d, z) in equal_pages(), (d2, z2) in equal_pages(),
        ) {
            agree_in_turn(&[(&d, &z), (&d2, &z2), (&d, &z)])?;
        }

        #[test]
        fn scattered_ranges_agree_with_the_reference(
            (d, z) in scattered(), (d2, z2) in slotted(),
        ) {
            agree_in_turn(&[(&d, &z), (&d2, &z2)])?;
        }
    }

    #[test]
    fn each_strategy_finds_a_late_overlap() {
        // 1,000 disjoint pages then one landing inside page 500, in shuffled order: the buckets
        // (span 4 n pages), packed keys (span 64 n pages) and pairs (span 2^45).
        for (stride, strategy) in [(4u64, "buckets"), (64, "keys"), (1 << 33, "pairs")] {
            let mut dst: Vec<u64> = (0..1000u64)
                .map(|i| (i * 7919 % 1000) * stride * 4096)
                .collect();
            let size = vec![4096u64; 1001];
            assert_eq!(
                check_disjoint(&dst[..1000], &size[..1000], &mut Scratch::default()),
                Ok(())
            );
            dst.push(500 * stride * 4096 + 4095);
            let got = check_disjoint(&dst, &size, &mut Scratch::default());
            assert_eq!(
                got,
                Err(DescriptorError::OverlappingDestinations {
                    first: (500 * stride * 4096, 4096),
                    second: (500 * stride * 4096 + 4095, 4096),
                }),
                "{strategy}"
            );
        }
    }

    #[test]
    fn pages_on_one_grid_are_compared_by_their_sizes() {
        // 24 KiB pages (3 * 2^13) on every seventh slot of a pool, shuffled: disjoint.
        let page = 24 << 10;
        let mut dst: Vec<u64> = (0..1000u64).map(|i| (i * 7919 % 1000) * 7 * page).collect();
        let mut scratch = Scratch::default();
        assert_eq!(
            check_disjoint(&dst, &vec![page; 1000], &mut scratch),
            Ok(())
        );
        // A page one slot on from another is still disjoint; on the same slot it is not.
        dst.push(700 * page + page);
        assert_eq!(
            check_disjoint(&dst, &vec![page; 1001], &mut scratch),
            Ok(())
        );
        dst.push(700 * page);
        assert_eq!(
            check_disjoint(&dst, &vec![page; 1002], &mut scratch),
            Err(DescriptorError::OverlappingDestinations {
                first: (700 * page, page),
                second: (700 * page, page),
            })
        );
        // Off the grid by a third of a page: it overlaps its neighbour.
        *dst.last_mut().unwrap() = 700 * page + page / 3;
        assert!(check_disjoint(&dst, &vec![page; 1002], &mut scratch).is_err());
        // One page twice as long, on the same grid: it reaches into the next slot's page.
        let (dst, mut size) = (
            (0..64u64).map(|i| i * 4096).collect::<Vec<_>>(),
            vec![4096; 64],
        );
        size[10] = 8192;
        assert_eq!(
            check_disjoint(&dst, &size, &mut scratch),
            Err(DescriptorError::OverlappingDestinations {
                first: (10 * 4096, 8192),
                second: (11 * 4096, 4096),
            })
        );
    }

    #[test]
    fn adjacent_pages_in_one_bucket_width_are_disjoint() {
        // Pages of 6,144 bytes: buckets are 4,096 wide, so neighbours share no bucket only by
        // luck; the check must compare ends, not buckets.
        let dst: Vec<u64> = (0..64u64).rev().map(|i| i * 6144).collect();
        assert_eq!(
            check_disjoint(&dst, &[6144; 64], &mut Scratch::default()),
            Ok(())
        );
        let mut short = dst.clone();
        short[10] += 1;
        assert!(check_disjoint(&short, &[6144; 64], &mut Scratch::default()).is_err());
    }
}
