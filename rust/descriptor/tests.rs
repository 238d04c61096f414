//! Unit tests of the descriptor module: cases by hand, arbitrary batches through `prepare_into`
//! (`fuzz`), and long batches of blocks against a reference that checks one descriptor at a time
//! (`blocks`). The overlap check's own tests are in `disjoint/tests.rs`.

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
        Batch { src, dst, size },
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
        Batch {
            src: &[0; 5],
            dst: &[1 << 63; 5],
            size: &[1 << 62; 5],
        },
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
    small.sort_unstable();
    assert_eq!(small, vec![(0x100, 0x1000, 64), (0x300, 0x3000, 8)]);
    let mut large: Vec<_> = (k..4).map(|i| (s[i], d[i], z[i])).collect();
    large.sort_unstable();
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
                    next += u64::from(gap);
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
            Batch {
                src: s,
                dst: d,
                size: z,
            },
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
            ranges.sort_unstable();
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
            let p = prepare_into(Batch { src: &s, dst: &d, size: &z }, Direction::HostToDevice,
                &regions(), true, Columns { src: &mut os, dst: &mut od, size: &mut oz },
                &mut Scratch::default()).unwrap();
            // No two consecutive outputs could have been merged: coalescing is maximal.
            for i in 1..p.len {
                prop_assert!(!(os[i - 1] + oz[i - 1] == os[i] && od[i - 1] + oz[i - 1] == od[i]));
            }
        }
    }
}

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
                    *pz += z[i];
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
            staged_blocks_at: 0,
            staged_blocks: 0,
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
            Batch {
                src: s,
                dst: d,
                size: z,
            },
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
