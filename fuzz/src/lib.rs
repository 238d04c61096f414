//! Inputs and invariant checks of the fuzz targets in `fuzz_targets/`.
//!
//! Each target decodes structured input (`arbitrary`) into a call of the library, then checks the
//! answer against a slow, obviously correct reference written here independently of the library:
//! no panic, the typed error the reference predicts, and on success descriptors that move exactly
//! the input's bytes with no two destinations overlapping.

use arbitrary::Arbitrary;
use blockswap::descriptor::{Columns, Direction};
use blockswap::region::{MemoryKind, RegionTable};

/// The largest power of two, at most 16, that divides every value (16 for none).
fn alignment_of(values: impl IntoIterator<Item = u64>) -> u64 {
    let bits = values.into_iter().fold(0u64, |acc, v| acc | v);
    1u64 << bits.trailing_zeros().min(4)
}

/// Whether any two of the non-empty ranges `(start, len)` share a byte. Ends are computed in
/// 128 bits, so the reference cannot overflow where the library must not.
fn any_overlap(ranges: &[(u64, u64)]) -> Option<((u64, u64), (u64, u64))> {
    let mut sorted = ranges.to_vec();
    sorted.sort_unstable();
    sorted
        .windows(2)
        .find(|w| w[0].0 as u128 + w[0].1 as u128 > w[1].0 as u128)
        .map(|w| (w[0], w[1]))
}

fn overlap(a: (u64, u64), b: (u64, u64)) -> bool {
    let (a0, a1) = (a.0 as u128, a.0 as u128 + a.1 as u128);
    let (b0, b1) = (b.0 as u128, b.0 as u128 + b.1 as u128);
    a0 < b1 && b0 < a1
}

/// The region of `kind` holding all of `[addr, addr + len)`, by a linear scan.
fn region_of(regions: &RegionTable, addr: u64, len: u64, kind: MemoryKind) -> Option<usize> {
    let end = addr as u128 + len as u128;
    regions
        .regions()
        .iter()
        .position(|r| r.kind == kind && r.start <= addr && end <= r.end as u128)
}

/// The bytes of `[addr, addr + len)` that no region of `kind` holds, as `[start, end)` ranges in
/// address order, by a linear scan.
fn gaps(regions: &RegionTable, addr: u64, len: u64, kind: MemoryKind) -> Vec<(u128, u128)> {
    let end = addr as u128 + len as u128;
    let mut at = addr as u128;
    let mut out = vec![];
    while at < end {
        let of_kind = || regions.regions().iter().filter(|r| r.kind == kind);
        match of_kind().find(|r| r.start as u128 <= at && at < r.end as u128) {
            Some(r) => at = r.end as u128,
            None => {
                let next = of_kind()
                    .map(|r| r.start as u128)
                    .filter(|&s| s > at)
                    .min()
                    .map_or(end, |s| s.min(end));
                out.push((at, next));
                at = next;
            }
        }
    }
    out
}

/// A region to register: small and page-aligned (most inputs), or any 64-bit range.
#[derive(Arbitrary, Debug)]
pub enum RegionSpec {
    Small {
        page: u16,
        pages: u8,
        host: bool,
    },
    /// The lower or the upper half of the address space: room for sizes near 2^63.
    Half {
        upper: bool,
        host: bool,
    },
    Raw {
        start: u64,
        len: u64,
        host: bool,
    },
}

fn kind(host: bool) -> MemoryKind {
    if host {
        MemoryKind::Host
    } else {
        MemoryKind::Device
    }
}

fn half(upper: bool, host: bool) -> (u64, u64, bool) {
    if upper {
        (1 << 63, (1 << 63) - 1, host)
    } else {
        (0, 1 << 63, host)
    }
}

fn build_regions(specs: &[RegionSpec]) -> RegionTable {
    let mut t = RegionTable::default();
    for spec in specs.iter().take(8) {
        let (start, len, host) = match *spec {
            RegionSpec::Small { page, pages, host } => {
                ((page as u64) << 12, (pages as u64 + 1) << 12, host)
            }
            RegionSpec::Half { upper, host } => half(upper, host),
            RegionSpec::Raw { start, len, host } => (start, len, host),
        };
        // Refusals (overlap, empty, overflow) are the region table's business, not fuzzed here.
        let _ = t.insert(start, len, kind(host));
    }
    t
}

/// Groups `naive` descriptors, in order, into the `out` descriptors: each output must be a run of
/// consecutive inputs contiguous in source and destination, and `must_merge(i)` says whether input
/// `i` has to continue the run of input `i - 1`. Panics on any mismatch.
fn check_grouping(
    naive: &[(u64, u64, u64)],
    out: &[(u64, u64, u64)],
    may_merge: impl Fn(usize) -> bool,
    must_merge: impl Fn(usize) -> bool,
) {
    let (mut j, mut off) = (0usize, 0u64);
    for (i, &(s, d, z)) in naive.iter().enumerate() {
        assert!(j < out.len(), "output ends before input {i}");
        let (os, od, oz) = out[j];
        assert_eq!(
            (os as u128 + off as u128, od as u128 + off as u128),
            (s as u128, d as u128),
            "input {i} is not where output {j} puts it"
        );
        if off > 0 {
            assert!(may_merge(i), "input {i} merged where it must not be");
        } else if i > 0 {
            assert!(!must_merge(i), "input {i} was not merged into its run");
        }
        off += z;
        assert!(off <= oz, "output {j} is shorter than its inputs");
        if off == oz {
            j += 1;
            off = 0;
        }
    }
    assert_eq!((j, off), (out.len(), 0), "outputs beyond the inputs");
}

fn outputs(cols: &(Vec<u64>, Vec<u64>, Vec<u64>), len: usize) -> Vec<(u64, u64, u64)> {
    (0..len)
        .map(|i| (cols.0[i], cols.1[i], cols.2[i]))
        .collect()
}

fn columns(n: usize) -> (Vec<u64>, Vec<u64>, Vec<u64>) {
    // A sentinel, so an output the library forgot to write is seen.
    let n = n.max(1);
    (vec![0xdead; n], vec![0xdead; n], vec![0xdead; n])
}

fn as_columns(c: &mut (Vec<u64>, Vec<u64>, Vec<u64>)) -> Columns<'_> {
    Columns {
        src: &mut c.0,
        dst: &mut c.1,
        size: &mut c.2,
    }
}

/// `descriptor::prepare_into`: validation, coalescing, the overlap check.
pub mod prepare {
    use super::*;
    use blockswap::descriptor::{prepare_into, DescriptorError, Scratch, Side};

    #[derive(Arbitrary, Debug)]
    pub enum Addr {
        /// Inside registered region `region` (modulo their number), at `offset` (modulo its size).
        In {
            region: u8,
            offset: u32,
        },
        /// Right after the previous descriptor's range on this side: coalescing material.
        Next,
        /// The address of an earlier descriptor on this side: overlaps and repeats.
        Back(u8),
        Raw(u64),
    }

    #[derive(Arbitrary, Debug)]
    pub enum Size {
        Small(u8),
        Medium(u16),
        /// `2^k`: sizes near the limits of the address space.
        Pow2(u8),
        Raw(u64),
    }

    #[derive(Arbitrary, Debug)]
    pub struct Desc {
        src: Addr,
        dst: Addr,
        size: Size,
    }

    #[derive(Arbitrary, Debug)]
    pub enum Lengths {
        Equal,
        ShortDst(u8),
        ShortSize(u8),
    }

    #[derive(Arbitrary, Debug)]
    pub struct Input {
        regions: Vec<RegionSpec>,
        descs: Vec<Desc>,
        direction: u8,
        lengths: Lengths,
    }

    type Batch = (Vec<u64>, Vec<u64>, Vec<u64>);

    fn build(input: &Input, regions: &RegionTable) -> Batch {
        let rs = regions.regions();
        let (mut src, mut dst, mut size) = (vec![], vec![], vec![]);
        let addr = |a: &Addr, side: &[u64], sizes: &[u64]| -> u64 {
            match *a {
                Addr::In { region, offset } if !rs.is_empty() => {
                    let r = rs[region as usize % rs.len()];
                    r.start + (offset as u64 % (r.end - r.start))
                }
                Addr::In { offset, .. } => offset as u64,
                Addr::Next => match (side.last(), sizes.last()) {
                    (Some(&a), Some(&z)) => a.wrapping_add(z),
                    _ => rs.first().map_or(0, |r| r.start),
                },
                Addr::Back(k) if !side.is_empty() => side[side.len() - 1 - k as usize % side.len()],
                Addr::Back(_) => 0,
                Addr::Raw(a) => a,
            }
        };
        for d in &input.descs {
            let s = addr(&d.src, &src, &size);
            let t = addr(&d.dst, &dst, &size);
            let z = match d.size {
                Size::Small(z) => z as u64,
                Size::Medium(z) => z as u64,
                Size::Pow2(k) => 1u64 << (k % 64),
                Size::Raw(z) => z,
            };
            src.push(s);
            dst.push(t);
            size.push(z);
        }
        match input.lengths {
            Lengths::Equal => {}
            Lengths::ShortDst(k) => dst.truncate(dst.len().saturating_sub(1 + k as usize)),
            Lengths::ShortSize(k) => size.truncate(size.len().saturating_sub(1 + k as usize)),
        }
        (src, dst, size)
    }

    /// The error a batch must be refused with, if any, worked out the slow way.
    fn reference_error(
        (src, dst, size): &Batch,
        direction: Direction,
        regions: &RegionTable,
    ) -> Option<DescriptorError> {
        let n = src.len();
        if dst.len() != n || size.len() != n {
            return Some(DescriptorError::LengthMismatch {
                src: n,
                dst: dst.len(),
                size: size.len(),
            });
        }
        if n == 0 {
            return Some(DescriptorError::Empty);
        }
        for i in 0..n {
            let (s, d, z) = (src[i], dst[i], size[i]);
            if z == 0 {
                return Some(DescriptorError::ZeroSize { index: i });
            }
            if z >= 1 << 63 {
                return Some(DescriptorError::NegativeSize {
                    index: i,
                    value: z as i64,
                });
            }
            for (side, addr) in [(Side::Src, s), (Side::Dst, d)] {
                if addr as u128 + z as u128 > u64::MAX as u128 {
                    return Some(DescriptorError::AddressOverflow {
                        index: i,
                        side,
                        addr,
                        size: z,
                    });
                }
            }
            for (side, addr, kind) in [
                (Side::Src, s, direction.src_kind()),
                (Side::Dst, d, direction.dst_kind()),
            ] {
                if region_of(regions, addr, z, kind).is_none() {
                    return Some(DescriptorError::OutOfRegion {
                        index: i,
                        side,
                        addr,
                        size: z,
                        kind,
                    });
                }
            }
        }
        let ranges: Vec<_> = dst.iter().copied().zip(size.iter().copied()).collect();
        any_overlap(&ranges)
            .map(|(first, second)| DescriptorError::OverlappingDestinations { first, second })
    }

    pub fn check(input: &Input) {
        let regions = build_regions(&input.regions);
        let direction = Direction::ALL[input.direction as usize % 4];
        let batch = build(input, &regions);
        let (src, dst, size) = &batch;
        let want = reference_error(&batch, direction, &regions);
        let mut scratch = Scratch::default();
        let mut results = vec![];
        // Both settings, one scratch: coalescing must not change validity, and the scratch must
        // carry nothing from one call to the next.
        for coalesce in [true, false] {
            let mut cols = columns(src.len());
            let got = prepare_into(
                blockswap::descriptor::Batch { src, dst, size },
                direction,
                &regions,
                coalesce,
                as_columns(&mut cols),
                &mut scratch,
            );
            match (&got, &want) {
                (
                    Err(DescriptorError::OverlappingDestinations { first, second }),
                    Some(DescriptorError::OverlappingDestinations { .. }),
                ) => {
                    // Any overlapping pair may be named; it must overlap, and lie in the batch's
                    // destinations (a coalesced run is the union of its inputs' ranges).
                    assert!(overlap(*first, *second), "named ranges do not overlap");
                    for r in [first, second] {
                        let covered = |d: u64| d >= r.0 && (d as u128) < r.0 as u128 + r.1 as u128;
                        assert!(
                            dst.iter().any(|&d| covered(d)),
                            "{r:?} is not a destination"
                        );
                    }
                }
                (Err(e), Some(w)) => assert_eq!(e, w),
                (Ok(p), None) => {
                    let out = outputs(&cols, p.len);
                    check_ok(&batch, direction, &regions, coalesce, p, &out);
                    results.push(out);
                }
                _ => panic!("prepare_into gave {got:?}; the reference says {want:?}"),
            }
        }
        if let [merged, plain] = &results[..] {
            let naive: Vec<_> = (0..src.len()).map(|i| (src[i], dst[i], size[i])).collect();
            assert_eq!(
                plain, &naive,
                "without coalescing the batch is copied as it is"
            );
            assert!(merged.len() <= plain.len());
        }
    }

    fn check_ok(
        (src, dst, size): &Batch,
        direction: Direction,
        regions: &RegionTable,
        coalesce: bool,
        p: &blockswap::descriptor::Prepared,
        out: &[(u64, u64, u64)],
    ) {
        let n = src.len();
        assert!(p.len >= 1 && p.len <= n);
        let naive: Vec<_> = (0..n).map(|i| (src[i], dst[i], size[i])).collect();
        let (sk, dk) = (direction.src_kind(), direction.dst_kind());
        let same_regions = |i: usize| {
            region_of(regions, src[i - 1], size[i - 1], sk)
                == region_of(regions, src[i], size[i], sk)
                && region_of(regions, dst[i - 1], size[i - 1], dk)
                    == region_of(regions, dst[i], size[i], dk)
        };
        let contiguous = |i: usize| {
            src[i - 1] as u128 + size[i - 1] as u128 == src[i] as u128
                && dst[i - 1] as u128 + size[i - 1] as u128 == dst[i] as u128
        };
        check_grouping(
            &naive,
            out,
            |i| coalesce && contiguous(i) && same_regions(i),
            |i| coalesce && contiguous(i) && same_regions(i),
        );
        for &(s, d, z) in out {
            assert!(z > 0);
            assert!(
                region_of(regions, s, z, sk).is_some(),
                "source outside a region"
            );
            assert!(
                region_of(regions, d, z, dk).is_some(),
                "destination outside a region"
            );
        }
        let total: u128 = size.iter().map(|&z| z as u128).sum();
        assert_eq!(p.bytes as u128, total);
        assert_eq!(p.max_size, out.iter().map(|o| o.2).max().unwrap());
        assert_eq!(
            p.alignment,
            alignment_of(src.iter().chain(dst.iter()).chain(size.iter()).copied())
        );
        let ranges: Vec<_> = out.iter().map(|o| (o.1, o.2)).collect();
        assert_eq!(
            any_overlap(&ranges),
            None,
            "accepted overlapping destinations"
        );
    }
}

/// `descriptor::check_disjoint` on its own: its bucket, packed-key and pair strategies.
pub mod disjoint {
    use super::*;
    use blockswap::descriptor::{check_disjoint, DescriptorError, Scratch};

    #[derive(Arbitrary, Debug)]
    pub struct Input {
        /// Destinations within 2^20 bytes (the packed-key sort) or anywhere (the pair sort).
        wide: bool,
        /// Pages of this many bytes in slots of a pool four times the batch, a few off the grid
        /// or short (the bucket strategy), instead of the two above.
        page: Option<u16>,
        ranges: Vec<(u64, u32)>,
        /// A second batch checked with the same scratch.
        again: Vec<(u64, u32)>,
    }

    fn build(input: &Input, ranges: &[(u64, u32)]) -> (Vec<u64>, Vec<u64>) {
        let slots = 4 * ranges.len() as u64 + 1;
        ranges
            .iter()
            .map(|&(d, z)| {
                if let Some(page) = input.page {
                    let page = page as u64 + 1;
                    let d = (d % slots) * page
                        + if z % 16 == 0 {
                            (z as u64 >> 4) % page
                        } else {
                            0
                        };
                    return (
                        d,
                        if z % 16 == 1 {
                            1 + (z as u64 >> 4) % page
                        } else {
                            page
                        },
                    );
                }
                let d = if input.wide { d } else { d % (1 << 20) }.min(u64::MAX - 1);
                // Non-empty and not overflowing: what prepare_into guarantees its caller.
                let z = 1 + (z as u64) % (u64::MAX - d);
                (d, z)
            })
            .unzip()
    }

    pub fn check(input: &Input) {
        let mut scratch = Scratch::default();
        for ranges in [&input.ranges, &input.again] {
            let (dst, size) = build(input, ranges);
            let pairs: Vec<_> = dst.iter().copied().zip(size.iter().copied()).collect();
            match (
                check_disjoint(&dst, &size, &mut scratch),
                any_overlap(&pairs),
            ) {
                (Ok(()), None) => {}
                (Err(DescriptorError::OverlappingDestinations { first, second }), Some(_)) => {
                    assert!(overlap(first, second));
                    assert!(pairs.contains(&first) && pairs.contains(&second));
                }
                (got, want) => panic!("check_disjoint gave {got:?}; the reference found {want:?}"),
            }
        }
    }
}

/// `descriptor::partition_small`: the split of a transfer between kernel and DMA.
pub mod partition {
    use super::*;
    use blockswap::descriptor::partition_small;

    #[derive(Arbitrary, Debug)]
    pub struct Input {
        descs: Vec<(u64, u64, u16)>,
        below: u16,
        /// Descriptors past `len` are left alone.
        tail: u8,
    }

    pub fn check(input: &Input) {
        let all: Vec<(u64, u64, u64)> = input
            .descs
            .iter()
            .map(|&(s, d, z)| (s, d, z as u64 + 1))
            .collect();
        let len = all.len().saturating_sub(input.tail as usize % 4);
        let below = input.below as u64;
        let mut cols = (
            all.iter().map(|t| t.0).collect::<Vec<_>>(),
            all.iter().map(|t| t.1).collect::<Vec<_>>(),
            all.iter().map(|t| t.2).collect::<Vec<_>>(),
        );
        let (k, max_size, alignment) = partition_small(as_columns(&mut cols), len, below);
        let got = outputs(&cols, all.len());
        let small: Vec<_> = all[..len].iter().filter(|t| t.2 < below).copied().collect();
        assert_eq!(k, small.len());
        assert!(got[..k].iter().all(|t| t.2 < below));
        assert!(got[k..len].iter().all(|t| t.2 >= below));
        assert_eq!(&got[len..], &all[len..], "past len nothing moves");
        let (mut a, mut b) = (got[..len].to_vec(), all[..len].to_vec());
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(a, b, "the same descriptors, reordered");
        assert_eq!(max_size, small.iter().map(|t| t.2).max().unwrap_or(0));
        assert_eq!(
            alignment,
            alignment_of(small.iter().flat_map(|t| [t.0, t.1, t.2]))
        );
    }
}

/// `table::BlockTable::new` and `table::expand_into`: block-id transfers.
pub mod expand {
    use super::*;
    use blockswap::descriptor::Scratch;
    use blockswap::table::{expand_into, BlockTable, Pair, TableError};

    const DEVICE: (u64, u64) = (0x10_0000, 0x10_0000);
    const HOST: (u64, u64) = (0x40_0000, 0x10_0000);

    #[derive(Arbitrary, Debug)]
    pub enum Value {
        Small(u8),
        Pow2(u8),
        Raw(u64),
    }

    impl Value {
        fn get(&self, scale: u64) -> u64 {
            match *self {
                Value::Small(v) => v as u64 * scale,
                Value::Pow2(k) => 1u64 << (k % 64),
                Value::Raw(v) => v,
            }
        }
    }

    #[derive(Arbitrary, Debug)]
    pub struct Segment {
        /// Offset from the start of the table's fixed region (or an address, when raw).
        base: Value,
        /// Padding added to the page (or the stride, when raw).
        pad: Value,
        page: Value,
    }

    #[derive(Arbitrary, Debug)]
    pub struct Table {
        host: bool,
        segments: Vec<Segment>,
        num_blocks: Value,
        unit: u8,
    }

    #[derive(Arbitrary, Debug)]
    pub enum DstIds {
        /// Block `(i + k) % num_blocks` for the i-th source: distinct while ids fit.
        Shift(u8),
        Own(Vec<Value>),
    }

    #[derive(Arbitrary, Debug)]
    pub struct Input {
        extra: Vec<RegionSpec>,
        /// Where the fixed regions are cut into adjacent pieces (offsets of 16 bytes, any order):
        /// tables may span them, pages and copies may not cross them.
        cuts: Vec<(bool, u16)>,
        src: Table,
        dst: Table,
        /// The destination table takes the source's page sizes (compatible tables).
        same_pages: bool,
        src_ids: Vec<Value>,
        dst_ids: DstIds,
    }

    type Spec = (Vec<u64>, Vec<u64>, Vec<u64>, u64, MemoryKind);

    fn spec(t: &Table, pages: Option<&[u64]>) -> Spec {
        let kind = kind(t.host);
        let region = if t.host { HOST } else { DEVICE };
        let mut bases = vec![];
        let mut strides = vec![];
        let mut nbytes = vec![];
        for (s, seg) in t.segments.iter().take(4).enumerate() {
            let page = match pages {
                Some(p) if s < p.len() => p[s],
                _ => seg.page.get(16),
            };
            let base = match seg.base {
                Value::Small(o) => region.0 + o as u64 * 256,
                ref v => v.get(1),
            };
            let stride = match seg.pad {
                Value::Small(p) => page.saturating_add(p as u64 % 4 * 16),
                ref v => v.get(1),
            };
            bases.push(base);
            strides.push(stride);
            nbytes.push(page);
        }
        let num_blocks = match t.num_blocks {
            Value::Small(n) => n as u64 % 64,
            ref v => v.get(1),
        };
        (bases, strides, nbytes, num_blocks, kind)
    }

    /// Whether `BlockTable::new` must accept the table, the slow way: `Some(true)` to accept,
    /// `Some(false)` to refuse because a page crosses a region boundary, `None` to refuse
    /// otherwise.
    fn valid((bases, strides, nbytes, nb, kind): &Spec, regions: &RegionTable) -> Option<bool> {
        let n = bases.len();
        let shaped = n > 0
            && *nb > 0
            && (0..n).all(|s| {
                let (b, st, z) = (bases[s] as u128, strides[s] as u128, nbytes[s] as u128);
                let len = (*nb as u128 - 1) * st + z;
                z > 0
                    && (*nb == 1 || st >= z)
                    && b + len <= u64::MAX as u128
                    // No page meets a byte no region of the kind holds: of the pages starting
                    // before a gap ends, the last reaches furthest into it.
                    && gaps(regions, bases[s], len as u64, *kind).iter().all(|&(g0, g1)| {
                        let block = if st == 0 || *nb == 1 {
                            0
                        } else {
                            ((g1 - 1 - b) / st).min(*nb as u128 - 1)
                        };
                        let page = b + block * st;
                        !(page < g1 && g0 < page + z)
                    })
            });
        if !shaped {
            return None;
        }
        // A region starting strictly inside a page: pages of a segment do not overlap, so the
        // only page that can hold an address is that of the last block starting before it.
        let straddles = (0..n).any(|s| {
            let (b, st, z) = (bases[s] as u128, strides[s] as u128, nbytes[s] as u128);
            regions.regions().iter().any(|r| {
                let c = r.start as u128;
                if c <= b {
                    return false;
                }
                let block = if st == 0 || *nb == 1 {
                    0
                } else {
                    ((c - b - 1) / st).min(*nb as u128 - 1)
                };
                let page = b + block * st;
                page < c && c < page + z
            })
        });
        Some(!straddles)
    }

    fn table(t: &Table, spec: &Spec, regions: &RegionTable) -> Option<BlockTable> {
        let (bases, strides, nbytes, nb, kind) = spec.clone();
        let got = BlockTable::new(bases, strides, nbytes, nb, kind, regions);
        match (&got, valid(spec, regions)) {
            (Ok(_), Some(true)) => {}
            (Err(TableError::Straddles { .. }), Some(false)) => {}
            (Err(TableError::BadSegment { .. } | TableError::NotRegistered { .. }), None) => {}
            _ => panic!("BlockTable::new({spec:?}) gave {got:?}"),
        }
        let unit = t.unit as u64 % 5;
        got.ok().map(|table| {
            if unit > 1 {
                table.named("T", unit)
            } else {
                table
            }
        })
    }

    /// The refusal `expand_into` must answer with, if any, worked out the slow way; `None` on
    /// success. `Some(None)`: refused because two destination pages overlap
    /// ([`TableError::OverlappingDestinations`]).
    fn reference_error(
        s: &BlockTable,
        sid: &[u64],
        d: &BlockTable,
        did: &[u64],
    ) -> Option<Option<TableError>> {
        if sid.len() != did.len() {
            return Some(Some(TableError::LengthMismatch {
                src: sid.len(),
                dst: did.len(),
            }));
        }
        if sid.is_empty() {
            return Some(Some(TableError::Empty));
        }
        if s.nbytes != d.nbytes {
            return Some(Some(TableError::Incompatible {
                src_segments: s.segments(),
                dst_segments: d.segments(),
                detail: String::new(),
            }));
        }
        for (ids, t) in [(sid, s), (did, d)] {
            if let Some(index) = ids.iter().position(|&id| id >= t.num_blocks) {
                return Some(Some(TableError::OutOfRange {
                    name: String::new(),
                    index,
                    id: 0,
                    num_blocks: t.num_blocks / t.unit,
                }));
            }
        }
        if let Some(index) = (1..did.len()).find(|&i| did[..i].contains(&did[i])) {
            return Some(Some(TableError::DuplicateDestination {
                name: String::new(),
                index,
                id: did[index] / d.unit,
            }));
        }
        let ranges: Vec<_> = naive(s, sid, d, did).iter().map(|t| (t.1, t.2)).collect();
        any_overlap(&ranges).map(|_| None)
    }

    /// Every (segment, block) pair, segment-major: what the transfer means.
    fn naive(s: &BlockTable, sid: &[u64], d: &BlockTable, did: &[u64]) -> Vec<(u64, u64, u64)> {
        let mut out = vec![];
        for seg in 0..s.segments() {
            for i in 0..sid.len() {
                out.push((
                    s.bases[seg] + sid[i] * s.strides[seg],
                    d.bases[seg] + did[i] * d.strides[seg],
                    s.nbytes[seg],
                ));
            }
        }
        out
    }

    fn same_variant(got: &TableError, want: &TableError) -> bool {
        std::mem::discriminant(got) == std::mem::discriminant(want)
    }

    pub fn check(input: &Input) {
        let mut regions = RegionTable::default();
        for (host, (start, len)) in [(false, DEVICE), (true, HOST)] {
            let mut at: Vec<u64> = input
                .cuts
                .iter()
                .take(6)
                .filter(|c| c.0 == host)
                .map(|c| c.1 as u64 * 16 % len)
                .filter(|&o| o > 0)
                .collect();
            at.sort_unstable();
            at.dedup();
            let mut from = 0;
            for end in at.into_iter().chain([len]) {
                regions
                    .insert(start + from, end - from, kind(host))
                    .unwrap();
                from = end;
            }
        }
        for r in input.extra.iter().take(4) {
            let (start, len, host) = match *r {
                RegionSpec::Small { .. } => continue,
                RegionSpec::Half { upper, host } => half(upper, host),
                RegionSpec::Raw { start, len, host } => (start, len, host),
            };
            let _ = regions.insert(start, len, kind(host));
        }
        let src_spec = spec(&input.src, None);
        let dst_spec = spec(&input.dst, input.same_pages.then_some(&src_spec.2[..]));
        let (Some(s), Some(d)) = (
            table(&input.src, &src_spec, &regions),
            table(&input.dst, &dst_spec, &regions),
        ) else {
            return;
        };
        let sid: Vec<u64> = input.src_ids.iter().map(|v| v.get(1)).collect();
        let did: Vec<u64> = match &input.dst_ids {
            DstIds::Shift(k) => (0..sid.len() as u64)
                .map(|i| (i + *k as u64) % d.num_blocks)
                .collect(),
            DstIds::Own(v) => v.iter().map(|v| v.get(1)).collect(),
        };
        let want = reference_error(&s, &sid, &d, &did);
        let mut scratch = Scratch::default();
        let mut results = vec![];
        // Both settings, with one scratch (and its bitset): neither may carry state between calls.
        for coalesce in [true, false] {
            let mut cols = columns(s.segments() * sid.len());
            let got = expand_into(
                Pair {
                    src: &s,
                    src_ids: &sid,
                    dst: &d,
                    dst_ids: &did,
                },
                coalesce,
                as_columns(&mut cols),
                &mut scratch,
            );
            match (&got, &want) {
                (Err(TableError::OverlappingDestinations { .. }), Some(None)) => {}
                (Err(e), Some(Some(w))) => {
                    assert!(same_variant(e, w), "expand_into gave {e:?}; expected {w:?}");
                    match (e, w) {
                        (
                            TableError::OutOfRange {
                                index: a,
                                num_blocks: x,
                                ..
                            },
                            TableError::OutOfRange {
                                index: b,
                                num_blocks: y,
                                ..
                            },
                        ) => assert_eq!((a, x), (b, y)),
                        (
                            TableError::DuplicateDestination {
                                index: a, id: x, ..
                            },
                            TableError::DuplicateDestination {
                                index: b, id: y, ..
                            },
                        ) => assert_eq!((a, x), (b, y)),
                        (TableError::Empty, _) | (TableError::Incompatible { .. }, _) => {}
                        _ => assert_eq!(e, w),
                    }
                    let _ = e.to_string();
                }
                (Ok(p), None) => {
                    let out = outputs(&cols, p.len);
                    let naive = naive(&s, &sid, &d, &did);
                    let n = sid.len();
                    // Pages that continue each other, in one region on each side (never joined
                    // across a boundary between two adjacent regions).
                    let contiguous = |i: usize| {
                        let (a, b) = (naive[i - 1], naive[i]);
                        !i.is_multiple_of(n)
                            && a.0 as u128 + a.2 as u128 == b.0 as u128
                            && a.1 as u128 + a.2 as u128 == b.1 as u128
                            && region_of(&regions, a.0, a.2 + b.2, s.kind).is_some()
                            && region_of(&regions, a.1, a.2 + b.2, d.kind).is_some()
                    };
                    check_grouping(
                        &naive,
                        &out,
                        |i| coalesce && contiguous(i),
                        |i| coalesce && contiguous(i),
                    );
                    let total: u128 = naive.iter().map(|t| t.2 as u128).sum();
                    assert_eq!(p.bytes as u128, total);
                    assert_eq!(p.max_size, out.iter().map(|o| o.2).max().unwrap());
                    // The reported alignment is a lower bound: it must divide every value.
                    assert!(p.alignment.is_power_of_two() && p.alignment <= 16);
                    assert!(out
                        .iter()
                        .all(|o| (o.0 | o.1 | o.2).is_multiple_of(p.alignment)));
                    for &(a, b, z) in &out {
                        assert!(region_of(&regions, a, z, s.kind).is_some());
                        assert!(region_of(&regions, b, z, d.kind).is_some());
                    }
                    results.push(out);
                }
                _ => panic!("expand_into gave {got:?}; the reference says {want:?}"),
            }
        }
        if let [merged, plain] = &results[..] {
            assert_eq!(plain, &naive(&s, &sid, &d, &did));
            assert!(merged.len() <= plain.len());
        }
    }
}
