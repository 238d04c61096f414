use super::*;

fn regions() -> RegionTable {
    let mut t = RegionTable::default();
    t.insert(0x10000, 0x10000, MemoryKind::Device).unwrap();
    t.insert(0x40000, 0x10000, MemoryKind::Host).unwrap();
    t
}

/// K/V split: two segments of 64-byte pages, 8 blocks each, padded to a 128-byte stride.
fn kv(base: u64, kind: MemoryKind) -> BlockTable {
    BlockTable::new(
        vec![base, base + 1024],
        vec![128, 128],
        vec![64, 64],
        8,
        kind,
        &regions(),
    )
    .unwrap()
}

/// The copies `expand_into` writes (coalesced), as `(src, dst, size)`.
pub(super) fn expand(
    s: &BlockTable,
    sid: &[u64],
    d: &BlockTable,
    did: &[u64],
) -> Result<Vec<(u64, u64, u64)>, TableError> {
    let n = s.segments() * sid.len().max(1);
    let (mut a, mut b, mut z) = (vec![0; n], vec![0; n], vec![0; n]);
    let p = expand_into(
        Pair {
            src: s,
            src_ids: sid,
            dst: d,
            dst_ids: did,
        },
        true,
        Columns {
            src: &mut a,
            dst: &mut b,
            size: &mut z,
        },
        &mut Scratch::default(),
    )?;
    Ok((0..p.len).map(|i| (a[i], b[i], z[i])).collect())
}

#[test]
fn registration_checks_segments_against_memory() {
    let r = regions();
    assert!(matches!(
        BlockTable::new(
            vec![0x10000],
            vec![128],
            vec![64],
            1024,
            MemoryKind::Device,
            &r
        ),
        Err(TableError::NotRegistered { segment: 0, .. })
    ));
    assert!(matches!(
        BlockTable::new(vec![0x10000], vec![32], vec![64], 8, MemoryKind::Device, &r),
        Err(TableError::BadSegment { .. })
    ));
    assert!(matches!(
        BlockTable::new(
            vec![0x40000],
            vec![128],
            vec![64],
            8,
            MemoryKind::Device,
            &r
        ),
        Err(TableError::NotRegistered { .. })
    ));
    assert!(matches!(
        BlockTable::new(
            vec![u64::MAX - 8],
            vec![128],
            vec![64],
            8,
            MemoryKind::Device,
            &r
        ),
        Err(TableError::BadSegment { .. })
    ));
    let t = kv(0x10000, MemoryKind::Device);
    assert!(t.disjoint);
    assert!(t.overlaps(0x10000, 0x10001) && !t.overlaps(0x40000, 0x50000));
}

#[test]
fn expands_segment_major_and_coalesces_consecutive_blocks() {
    let g = kv(0x10000, MemoryKind::Device);
    // Dense pages (stride == page) so consecutive blocks are contiguous.
    let h = BlockTable::new(
        vec![0x40000, 0x40000 + 512],
        vec![64, 64],
        vec![64, 64],
        8,
        MemoryKind::Host,
        &regions(),
    )
    .unwrap();
    let out = expand(&g, &[3, 5], &h, &[0, 1]).unwrap();
    assert_eq!(
        out,
        vec![
            (0x10000 + 3 * 128, 0x40000, 64),
            (0x10000 + 5 * 128, 0x40000 + 64, 64),
            (0x10400 + 3 * 128, 0x40200, 64),
            (0x10400 + 5 * 128, 0x40200 + 64, 64),
        ]
    );
    // Host -> host with dense pages on both sides: consecutive ids merge per segment.
    let out = expand(&h, &[2, 3, 4], &h, &[5, 6, 7]).unwrap();
    assert_eq!(out, vec![(0x40080, 0x40140, 192), (0x40280, 0x40340, 192)]);
}

#[test]
fn refuses_bad_ids_by_name() {
    let g = kv(0x10000, MemoryKind::Device);
    let h = kv(0x40000, MemoryKind::Host);
    assert_eq!(
        expand(&g, &[1], &h, &[1, 2]),
        Err(TableError::LengthMismatch { src: 1, dst: 2 })
    );
    assert_eq!(expand(&g, &[], &h, &[]), Err(TableError::Empty));
    let e = expand(&g, &[1, 8], &h, &[1, 2]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "source block ids hold block id 8, out of range (at position 1; there are 8 blocks)"
    );
    let e = expand(&g, &[1], &h, &[(-1i64) as u64]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "destination block ids hold a negative block id (-1, at position 0)"
    );
    let e = expand(&g, &[1, 1, 2], &h, &[4, 5, 4]).unwrap_err();
    assert_eq!(
        e,
        TableError::DuplicateDestination {
            name: "destination".into(),
            index: 2,
            id: 4
        }
    );
    // Named tables count in the caller's units: CPU blocks of 4 sub-blocks.
    let named = kv(0x40000, MemoryKind::Host).named("CPU", 4);
    let e = expand(&g, &[1, 2], &named, &[5, 5]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "CPU block id 1 is a destination more than once (again at position 1)"
    );
    // The bitset is left clear: the same ids are fine in the next transfer.
    let mut bits = Vec::new();
    assert_eq!(unique(&[4, 5, 4], 8, &mut bits, &mut vec![]), Err(2));
    assert!(bits.iter().all(|&w| w == 0));
    // A huge table is checked by sorting, not with a bitset of its size (found by the
    // `expand` fuzz target: 2^50 blocks asked for a 176 TB bitset).
    let huge = 1u64 << 50;
    let mut pairs = vec![];
    assert_eq!(
        unique(&[7, huge - 1, 3, huge - 1, 7], huge, &mut bits, &mut pairs),
        Err(3)
    );
    assert_eq!(
        unique(&[7, huge - 1, 3], huge, &mut bits, &mut pairs),
        Ok(())
    );
    assert!(bits.len() <= 1);
    let narrow = BlockTable::new(
        vec![0x40000],
        vec![128],
        vec![32],
        8,
        MemoryKind::Host,
        &regions(),
    )
    .unwrap();
    assert!(matches!(
        expand(&g, &[1], &narrow, &[1]),
        Err(TableError::Incompatible { .. })
    ));
}

#[test]
fn overlapping_huge_segments_are_refused_not_summed_past_u64() {
    // Five destination segments over the same 2^62 bytes: their byte count passes 2^64.
    let mut r = RegionTable::default();
    r.insert(0, 1 << 63, MemoryKind::Host).unwrap();
    r.insert(1 << 63, (1 << 63) - 1, MemoryKind::Device)
        .unwrap();
    let table = |base, kind| {
        BlockTable::new(
            vec![base; 5],
            vec![1 << 60; 5],
            vec![1 << 60; 5],
            4,
            kind,
            &r,
        )
        .unwrap()
    };
    let (h, g) = (
        table(0, MemoryKind::Host),
        table(1 << 63, MemoryKind::Device),
    );
    assert!(matches!(
        expand(&h, &[0, 1, 2, 3], &g, &[0, 1, 2, 3]),
        Err(TableError::OverlappingDestinations {
            within: Overlap::Segments(0, 1),
            ..
        })
    ));
}

#[test]
fn a_block_plan_run_stays_inside_one_allocation() {
    let r = regions();
    // Four layer pages at one pitch on each side: one run of four rows...
    let gpu = |split: u64| {
        BlockTable::new(
            (0..4).map(|l| 0x10000 + l * 0x800).collect(),
            vec![64; 4],
            vec![64; 4],
            8,
            MemoryKind::Device,
            &r,
        )
        .unwrap()
        .in_allocations(move |a| Some(if a < split { 0x10000 } else { split }))
    };
    let cpu = BlockTable::new(
        (0..4).map(|l| 0x40000 + l * 64).collect(),
        vec![256; 4],
        vec![64; 4],
        8,
        MemoryKind::Host,
        &r,
    )
    .unwrap();
    let rows = |g: &BlockTable| {
        block_runs(g, &cpu)
            .unwrap()
            .iter()
            .map(|r| r.rows)
            .collect::<Vec<_>>()
    };
    assert_eq!(rows(&gpu(u64::MAX)), vec![4]);
    // ...cut where the layers lie in two driver allocations (the driver refuses a pitched
    // copy whose rows span two).
    assert_eq!(rows(&gpu(0x11000)), vec![2, 2]);
}

#[test]
fn overlapping_segments_fall_back_to_a_full_check() {
    let r = regions();
    // Two segments whose spans interleave (K and V of one block side by side): proven
    // disjoint by their offsets inside one block stride, no per-transfer check needed.
    let t = BlockTable::new(
        vec![0x10000, 0x10040],
        vec![128, 128],
        vec![64, 64],
        8,
        MemoryKind::Device,
        &r,
    )
    .unwrap();
    assert!(t.disjoint);
    let h = kv(0x40000, MemoryKind::Host);
    assert!(expand(&h, &[0, 1], &t, &[2, 3]).is_ok());
    // Pages 64 bytes apart that overlap: segment 1 of block b starts inside segment 0's.
    let bad = BlockTable::new(
        vec![0x10000, 0x10020],
        vec![128, 128],
        vec![64, 64],
        8,
        MemoryKind::Device,
        &r,
    )
    .unwrap();
    assert!(!bad.disjoint);
    assert_eq!(bad.shared_segments(), Some((0, 1)));
    assert!(matches!(
        expand(&h, &[0], &bad, &[0]),
        Err(TableError::OverlappingDestinations {
            within: Overlap::Segments(0, 1),
            ..
        })
    ));
}

#[test]
fn fragments_of_several_tensors_are_proven_disjoint_tensor_by_tensor() {
    let r = regions();
    // Two layer tensors 4 KiB apart, each holding two 64-byte fragments of every 256-byte page
    // (vLLM's canonical layout views a page's fragments as segments): the tensors' spans lie
    // apart and the fragments of each interleave, so no transfer needs the sorted check.
    let frags = |at: &[u64]| {
        BlockTable::new(
            at.to_vec(),
            vec![256; at.len()],
            vec![64; at.len()],
            8,
            MemoryKind::Device,
            &r,
        )
        .unwrap()
    };
    let t = frags(&[0x10000, 0x10080, 0x11000, 0x11040]);
    assert!(t.disjoint);
    let h = BlockTable::new(
        vec![0x40000, 0x40040, 0x40080, 0x400c0],
        vec![256; 4],
        vec![64; 4],
        8,
        MemoryKind::Host,
        &r,
    )
    .unwrap();
    assert!(expand(&h, &[0, 1], &t, &[2, 3]).is_ok());
    // The second tensor's fragments overlap (32 bytes apart): the table is not proven
    // disjoint, and a transfer writing them is refused.
    let bad = frags(&[0x10000, 0x10080, 0x11000, 0x11020]);
    assert!(!bad.disjoint);
    assert!(matches!(
        expand(&h, &[0], &bad, &[0]),
        Err(TableError::OverlappingDestinations { .. })
    ));
    // A fragment past the page's stride in one tensor overlaps the next block's page.
    let long = frags(&[0x10000, 0x10080, 0x11000, 0x110e0]);
    assert!(!long.disjoint);
}

/// `layers` GPU layers of `page`-byte pages (8 blocks each, layer after layer in one
/// allocation unless `split` cuts them) and a block-major CPU cache of the same pages.
fn block_route_tables(page: u64, layers: u64, split: Option<u64>) -> (BlockTable, BlockTable) {
    let mut r = RegionTable::default();
    r.insert(0x100_0000, 0x100_0000, MemoryKind::Device)
        .unwrap();
    r.insert(0x1000_0000, 0x100_0000, MemoryKind::Host).unwrap();
    let layer = 8 * page;
    let gpu = BlockTable::new(
        (0..layers).map(|l| 0x100_0000 + l * layer).collect(),
        vec![page; layers as usize],
        vec![page; layers as usize],
        8,
        MemoryKind::Device,
        &r,
    )
    .unwrap()
    .in_allocations(move |a| Some(split.filter(|&s| a >= s).unwrap_or(0x100_0000)));
    let cpu = BlockTable::new(
        (0..layers).map(|l| 0x1000_0000 + l * page).collect(),
        vec![layers * page; layers as usize],
        vec![page; layers as usize],
        8,
        MemoryKind::Host,
        &r,
    )
    .unwrap();
    (gpu, cpu)
}

#[test]
fn the_block_route_is_taken_where_few_copies_of_large_pages_save_copies() {
    let (gpu, cpu) = block_route_tables(BLOCK_MIN_PAGE, 4, None);
    assert_eq!(
        block_route(&[(&gpu, &cpu)], true, false),
        Ok(format!(
            "blocks: 1 2-D copy per block (4 pages of {BLOCK_MIN_PAGE} B, GPU pitch {} B), copy \
             engines only",
            8 * BLOCK_MIN_PAGE
        ))
    );
    // CPU -> GPU: the GPU side is the destination, and its pitch is named.
    let up = block_route(&[(&cpu, &gpu)], false, false).unwrap();
    assert!(
        up.contains(&format!("GPU pitch {} B", 8 * BLOCK_MIN_PAGE)),
        "{up}"
    );

    // Smaller pages take another route by default; `insist` takes the block plan anyway.
    let (gpu, cpu) = block_route_tables(BLOCK_MIN_PAGE / 4, 4, None);
    let small = block_route(&[(&gpu, &cpu)], true, false).unwrap_err();
    assert!(small.contains("below 65536 B"), "{small}");
    assert!(block_route(&[(&gpu, &cpu)], true, true).is_ok());

    // Layers in three allocations: three copies per block, more than BLOCK_MAX_COPIES.
    let cut = 0x100_0000 + 8 * BLOCK_MIN_PAGE;
    let (gpu, cpu) = block_route_tables(BLOCK_MIN_PAGE, 4, Some(cut));
    assert_eq!(block_runs(&gpu, &cpu).unwrap().len(), 2);
    assert!(block_route(&[(&gpu, &cpu)], true, false).is_ok());
    let (gpu, cpu) = block_route_tables(BLOCK_MIN_PAGE, 6, None);
    let many = |t: &BlockTable| {
        t.clone()
            .in_allocations(move |a| Some(a / (2 * 8 * BLOCK_MIN_PAGE)))
    };
    let (gpu3, cpu3) = (many(&gpu), cpu.clone());
    assert_eq!(block_runs(&gpu3, &cpu3).unwrap().len(), 3);
    let three = block_route(&[(&gpu3, &cpu3)], true, false).unwrap_err();
    assert!(
        three.contains("3 2-D copies per block, more than 2"),
        "{three}"
    );
    assert!(block_route(&[(&gpu3, &cpu3)], true, true)
        .unwrap()
        .contains("3 2-D copies per block"));
}

#[test]
fn the_block_route_is_refused_where_it_saves_nothing_or_groups_share_memory() {
    let (gpu, cpu) = block_route_tables(BLOCK_MIN_PAGE, 1, None);
    let one = block_route(&[(&gpu, &cpu)], true, true).unwrap_err();
    assert!(one.contains("save none of its 1 pages"), "{one}");

    let (gpu, cpu) = block_route_tables(BLOCK_MIN_PAGE, 4, None);
    let (other_gpu, _) = block_route_tables(BLOCK_MIN_PAGE / 2, 4, None);
    let differ = block_route(&[(&other_gpu, &cpu)], true, true).unwrap_err();
    assert!(differ.contains("pages differ"), "{differ}");

    // Two groups on the same CPU cache: their copies could not be proven apart.
    let shared = block_route(&[(&gpu, &cpu), (&gpu, &cpu)], true, false).unwrap_err();
    assert!(shared.contains("share memory"), "{shared}");
    assert!(block_route(&[], true, true).is_err());
}
