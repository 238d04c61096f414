//! Block tables over memory registered in adjacent pieces (a large host buffer): accepted
//! where no page crosses from one piece into the next, and no copy ever does.
use super::*;
use proptest::prelude::*;
use std::collections::BTreeMap;

const DEV: u64 = 0x100000;
const HOST: u64 = 0x800000;

/// One device region of `dev_len`; host memory of `host_len` registered in pieces that begin
/// at the offsets `cuts`.
fn regions(dev_len: u64, host_len: u64, cuts: &[u64]) -> RegionTable {
    regions_with_holes(dev_len, host_len, cuts, &[])
}

/// As [`regions`], with the pieces numbered in `holes` left unregistered.
fn regions_with_holes(dev_len: u64, host_len: u64, cuts: &[u64], holes: &[usize]) -> RegionTable {
    let mut t = RegionTable::default();
    t.insert(DEV, dev_len, MemoryKind::Device).unwrap();
    let mut at = 0;
    for (k, &c) in cuts.iter().chain([&host_len]).enumerate() {
        if holes.contains(&k) {
            at = c;
            continue;
        }
        if at == 0 {
            t.insert(HOST, c, MemoryKind::Host).unwrap();
        } else {
            t.insert_piece(HOST + at, c - at, MemoryKind::Host).unwrap();
        }
        at = c;
    }
    t
}

/// A block-major CPU table (every page of a block in one row) of `segs` pages of `z` bytes.
fn block_major(segs: u64, z: u64, nb: u64, r: &RegionTable) -> Result<BlockTable, TableError> {
    BlockTable::new(
        (0..segs).map(|s| HOST + s * z).collect(),
        vec![segs * z; segs as usize],
        vec![z; segs as usize],
        nb,
        MemoryKind::Host,
        r,
    )
}

/// One rank's cells of a region four ranks share (rows of 1 KiB, a 256-byte cell each, rank 1's
/// registered a cell at a time): two tensors' 64-byte pages at `offsets` in each cell.
fn rank_cells(offsets: &[u64], r: &RegionTable) -> Result<BlockTable, TableError> {
    let n = offsets.len();
    let bases = offsets.iter().map(|o| HOST + 256 + o).collect();
    BlockTable::new(bases, vec![1024; n], vec![64; n], 6, MemoryKind::Host, r)
}

#[test]
fn a_table_may_lie_in_cells_registered_one_by_one() {
    let mut r = RegionTable::default();
    for row in 0..6 {
        r.insert(HOST + row * 1024 + 256, 256, MemoryKind::Host)
            .unwrap();
    }
    let t = rank_cells(&[0, 128], &r).unwrap();
    // Every cell after the first begins a registration no copy crosses into.
    let starts: Vec<u64> = (1..6).map(|row| HOST + row * 1024 + 256).collect();
    assert_eq!(t.cuts(), starts);
    // A block's pages lie in its cell: the staged plan takes the cell (holes and all).
    assert_eq!(staged_cell(&t), Some((192, true)));
    // A page that reaches out of its cell into the next rank's is refused, named.
    let out = rank_cells(&[0, 224], &r);
    assert!(
        matches!(out, Err(TableError::NotRegistered { segment: 1, start, len: 64, .. })
            if start == HOST + 256 + 224),
        "{out:?}"
    );
    // A cell left unregistered: refused at its first page.
    let mut missing = r.clone();
    missing.remove(HOST + 3 * 1024 + 256).unwrap();
    let out = rank_cells(&[0, 128], &missing);
    assert!(
        matches!(out, Err(TableError::NotRegistered { segment: 0, start, .. })
            if start == HOST + 3 * 1024 + 256),
        "{out:?}"
    );
    // Another kind of memory in a cell's place: not this table's either.
    let mut kinds = missing;
    kinds
        .insert(HOST + 3 * 1024 + 256, 256, MemoryKind::Device)
        .unwrap();
    assert!(matches!(
        rank_cells(&[0, 128], &kinds),
        Err(TableError::NotRegistered { segment: 0, .. })
    ));
}

#[test]
fn a_table_may_span_adjacent_regions_if_no_page_crosses_a_boundary() {
    // Rows of two 64-byte pages, 8 blocks, pieces of 3 rows: cut at 384 and 768.
    let r = regions(0x1000, 1024, &[384, 768]);
    let t = block_major(2, 64, 8, &r).unwrap();
    assert_eq!(t.cuts(), [HOST + 384, HOST + 768]);
    // A cut inside a row but between its pages is fine too.
    let r = regions(0x1000, 1024, &[64, 448]);
    assert!(block_major(2, 64, 8, &r).is_ok());
    // A cut inside a page: refused, naming the segment, the block and the boundary.
    let r = regions(0x1000, 1024, &[384, 800]);
    let e = block_major(2, 64, 8, &r).unwrap_err();
    assert_eq!(
        e,
        TableError::Straddles {
            segment: 0,
            block: 6,
            page: HOST + 768,
            nbytes: 64,
            boundary: HOST + 800
        }
    );
    let msg = e.to_string();
    assert!(
        msg.starts_with("block table segment 0: the page of block 6")
            && msg.contains(&format!("crosses the boundary at {:#x}", HOST + 800)),
        "{msg}"
    );
    // Segment 1's page of block 3 holds offset 448.
    let r = regions(0x1000, 1024, &[400, 448 + 8]);
    assert!(matches!(
        block_major(2, 64, 8, &r),
        Err(TableError::Straddles {
            segment: 0,
            block: 3,
            ..
        })
    ));
    let r = regions(0x1000, 1024, &[456]);
    assert!(matches!(
        block_major(2, 64, 8, &r),
        Err(TableError::Straddles {
            segment: 1,
            block: 3,
            boundary,
            ..
        }) if boundary == HOST + 456
    ));
    // A gap, or the wrong kind next door: not registered.
    let mut gap = RegionTable::default();
    gap.insert(HOST, 384, MemoryKind::Host).unwrap();
    gap.insert(HOST + 400, 1024, MemoryKind::Host).unwrap();
    assert!(matches!(
        block_major(2, 64, 8, &gap),
        Err(TableError::NotRegistered { segment: 0, .. })
    ));
    let mut kinds = RegionTable::default();
    kinds.insert(HOST, 384, MemoryKind::Host).unwrap();
    kinds.insert(HOST + 384, 1024, MemoryKind::Device).unwrap();
    assert!(matches!(
        block_major(2, 64, 8, &kinds),
        Err(TableError::NotRegistered { .. })
    ));
    // One block, a stride smaller than its page: only that page counts.
    let r = regions(0x1000, 1024, &[32]);
    let one = |base| BlockTable::new(vec![base], vec![0], vec![64], 1, MemoryKind::Host, &r);
    assert!(matches!(
        one(HOST),
        Err(TableError::Straddles { block: 0, .. })
    ));
    assert!(one(HOST + 32).is_ok());
}

#[test]
fn pages_that_continue_each_other_across_a_boundary_stay_apart() {
    // One 64-byte page per row: consecutive blocks coalesce, except across a cut (192).
    let r = regions(0x1000, 1024, &[192]);
    let cpu = block_major(1, 64, 16, &r).unwrap();
    let gpu = BlockTable::new(vec![DEV], vec![64], vec![64], 16, MemoryKind::Device, &r).unwrap();
    let got = super::tests::expand(&gpu, &[0, 1, 2, 3, 4], &cpu, &[1, 2, 3, 4, 5]).unwrap();
    assert_eq!(
        got,
        vec![(DEV, HOST + 64, 128), (DEV + 128, HOST + 192, 192)],
        "the run is cut where the CPU side crosses into the second piece"
    );
    // The same on the source side of the other direction.
    let got = super::tests::expand(&cpu, &[1, 2, 3, 4, 5], &gpu, &[0, 1, 2, 3, 4]).unwrap();
    assert_eq!(got.len(), 2);
}

#[test]
fn a_block_plan_never_joins_rows_across_a_boundary() {
    // A CPU row of four 64-byte pages; a cut inside row 2, between its second and third page.
    let r = regions(0x10000, 2048, &[2 * 256 + 128]);
    let cpu = block_major(4, 64, 8, &r).unwrap();
    // Layers at one pitch on the GPU: one run of four rows per block where nothing cuts it.
    let gpu = BlockTable::new(
        (0..4).map(|l| DEV + l * 0x800).collect(),
        vec![64; 4],
        vec![64; 4],
        8,
        MemoryKind::Device,
        &r,
    )
    .unwrap();
    let rows = |a: &BlockTable, b: &BlockTable| {
        block_runs(a, b)
            .unwrap()
            .iter()
            .map(|r| r.rows)
            .collect::<Vec<_>>()
    };
    assert_eq!(rows(&gpu, &cpu), vec![2, 2]);
    assert_eq!(rows(&cpu, &gpu), vec![2, 2]);
    let whole = regions(0x10000, 2048, &[]);
    assert_eq!(rows(&gpu, &block_major(4, 64, 8, &whole).unwrap()), vec![4]);
    // Cuts between rows leave every block's run whole.
    let rows_apart = regions(0x10000, 2048, &[256, 3 * 256]);
    assert_eq!(
        rows(&gpu, &block_major(4, 64, 8, &rows_apart).unwrap()),
        vec![4]
    );
    // Layer tables of 8 pages each: segments 0-1 in the first piece, 2-3 in the second (a
    // seam at 1024, though no segment's span crosses it). Their rows never join there...
    let per_layer = |r: &RegionTable| {
        BlockTable::new(
            (0..4).map(|l| HOST + l * 512).collect(),
            vec![64; 4],
            vec![64; 4],
            8,
            MemoryKind::Host,
            r,
        )
        .unwrap()
    };
    let pieces = regions(0x10000, 2048, &[1024]);
    assert_eq!(per_layer(&pieces).cuts(), [HOST + 1024]);
    assert_eq!(rows(&gpu, &per_layer(&pieces)), vec![2, 2]);
    // ...while regions that merely touch (two registrations, say a tensor's K and V halves)
    // keep the plan whole, as before.
    let mut touching = RegionTable::default();
    touching.insert(DEV, 0x10000, MemoryKind::Device).unwrap();
    touching.insert(HOST, 1024, MemoryKind::Host).unwrap();
    touching
        .insert(HOST + 1024, 1024, MemoryKind::Host)
        .unwrap();
    assert!(per_layer(&touching).cuts().is_empty());
    assert_eq!(rows(&gpu, &per_layer(&touching)), vec![4]);
}

/// Where every descriptor or 2-D copy row of a slab lies: the region of each side.
fn region_of(r: &RegionTable, addr: u64, len: u64, kind: MemoryKind) -> usize {
    let mut hint = usize::MAX;
    r.locate(addr, len, kind, &mut hint)
        .unwrap_or_else(|| panic!("[{addr:#x}, +{len}) crosses a region boundary"))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 2 } else { 256 }))]

    /// Over host memory cut at any byte offsets, some pieces left unregistered (`holes`: the
    /// cells of other ranks), a table is refused exactly where a page touches a hole or holds
    /// a cut strictly inside it; an accepted one moves the bytes of the naive copy, page by
    /// page and by block plan, in descriptors and 2-D copies each inside one region on each
    /// side (every row of a 2-D copy in the same one).
    #[test]
    fn copies_stay_inside_one_region(
        z in (1u64..5).prop_map(|p| p * 16),
        segs in 1u64..5,
        nb in 1u64..20,
        block_major_cpu in any::<bool>(),
        cut_at in prop::collection::vec((0u64..400, any::<bool>()), 0..6),
        runs in prop::collection::vec((0u64..20, 1u64..5), 1..5),
        start in 0u64..20,
        d2h in any::<bool>(),
        holes in prop::collection::vec(0usize..7, 0..3),
    ) {
        let host_len = segs * nb * z;
        // Cuts at page multiples (always fine for these layouts) or at any byte.
        let mut cuts: Vec<u64> = cut_at
            .iter()
            .map(|&(k, paged)| if paged { k % (segs * nb) * z } else { k * 7 % host_len })
            .filter(|&c| c > 0 && c < host_len)
            .collect();
        cuts.sort_unstable();
        cuts.dedup();
        // The pieces' bounds (offsets); the last piece is never a hole.
        let bounds: Vec<u64> =
            [0].into_iter().chain(cuts.iter().copied()).chain([host_len]).collect();
        let holes: Vec<usize> = holes.into_iter().filter(|&k| k + 1 < bounds.len() - 1).collect();
        let r = regions_with_holes(0x100000, host_len, &cuts, &holes);
        let in_hole = |p: u64| holes.iter().any(|&k| {
            p < HOST + bounds[k + 1] && HOST + bounds[k] < p + z
        });
        let (cb, cs): (Vec<u64>, u64) = if block_major_cpu {
            ((0..segs).map(|s| HOST + s * z).collect(), segs * z)
        } else {
            ((0..segs).map(|s| HOST + s * nb * z).collect(), z)
        };
        let cpu = BlockTable::new(cb.clone(), vec![cs; segs as usize],
            vec![z; segs as usize], nb, MemoryKind::Host, &r);
        let straddles = (0..segs as usize).any(|s| (0..nb).any(|b| {
            let p = cb[s] + b * cs;
            cuts.iter().any(|&c| p < HOST + c && HOST + c < p + z)
        }));
        let unregistered = (0..segs as usize).any(|s| (0..nb).any(|b| in_hole(cb[s] + b * cs)));
        let cpu = match cpu {
            Err(TableError::NotRegistered { segment, start, len, .. }) if unregistered => {
                // The first page of its segment that touches a hole, and no earlier segment's.
                prop_assert!(in_hole(start) && len == z);
                prop_assert!((0..segment).all(|s| (0..nb).all(|b| !in_hole(cb[s] + b * cs))));
                prop_assert!((0..nb).map(|b| cb[segment] + b * cs).find(|&p| in_hole(p))
                    == Some(start));
                return Ok(());
            }
            Err(e) if unregistered => return Err(TestCaseError::fail(format!("{e}"))),
            Ok(_) if unregistered => return Err(TestCaseError::fail("accepted a hole")),
            Err(TableError::Straddles { .. }) if straddles => return Ok(()),
            Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
            Ok(_) if straddles => return Err(TestCaseError::fail("accepted a straddle")),
            Ok(t) => t,
        };
        // Layers at one pitch on the GPU, pages dense in each.
        let gpu = BlockTable::new((0..segs).map(|s| DEV + s * 0x4000).collect(),
            vec![z; segs as usize], vec![z; segs as usize], nb, MemoryKind::Device, &r)
            .unwrap();
        let mut gid = vec![];
        for (first, len) in runs {
            gid.extend((first..first + len).filter(|&b| b < nb));
        }
        gid.dedup();
        let mut seen = std::collections::HashSet::new();
        gid.retain(|b| seen.insert(*b));
        prop_assume!(!gid.is_empty());
        let cid: Vec<u64> = (0..gid.len() as u64).map(|i| (start + i) % nb).collect();
        let (src, sid, dst, did) = if d2h {
            (&gpu, &gid, &cpu, &cid)
        } else {
            (&cpu, &cid, &gpu, &gid)
        };
        let mut want = BTreeMap::new();
        for s in 0..segs as usize {
            for i in 0..sid.len() {
                for k in 0..z {
                    want.insert(dst.bases[s] + did[i] * dst.strides[s] + k,
                        src.bases[s] + sid[i] * src.strides[s] + k);
                }
            }
        }
        let n = segs as usize * sid.len();
        let (mut a, mut b, mut c) = (vec![0; 2 * n], vec![0; 2 * n], vec![0; 2 * n]);
        let p = expand_into(Pair { src, src_ids: sid, dst, dst_ids: did }, true,
            Columns { src: &mut a, dst: &mut b, size: &mut c },
            &mut Scratch::default()).unwrap();
        let mut got = BTreeMap::new();
        for i in 0..p.len {
            region_of(&r, a[i], c[i], src.kind);
            region_of(&r, b[i], c[i], dst.kind);
            for k in 0..c[i] {
                got.insert(b[i] + k, a[i] + k);
            }
        }
        prop_assert_eq!(&got, &want);
        let plan = block_runs(src, dst).unwrap();
        let m = PITCHED_ENTRIES * plan.len() * sid.len();
        prop_assert!(m <= a.len());
        let p = expand_runs_into(Pair { src, src_ids: sid, dst, dst_ids: did }, &plan,
            Columns { src: &mut a, dst: &mut b, size: &mut c },
            &mut Scratch::default()).unwrap();
        let mut got = BTreeMap::new();
        let mut copy_regions: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
        for_each_row(&a[..p.len], &b[..p.len], &c[..p.len], |k, s, d, width| {
            let rs = (region_of(&r, s, width, src.kind), region_of(&r, d, width, dst.kind));
            assert_eq!(*copy_regions.entry(k).or_insert(rs), rs,
                "rows of one 2-D copy in different regions");
            for x in 0..width {
                got.insert(d + x, s + x);
            }
        });
        prop_assert_eq!(&got, &want);
    }
}
