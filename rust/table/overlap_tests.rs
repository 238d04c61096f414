//! The rule every plan keeps for what one transfer writes (no byte twice), plan by plan: pages,
//! the block plan's 2-D copies and the staged plan, within a table and across groups.

use super::*;
use crate::plan::Plan;

const GPU: u64 = 0x10000;
const HOST: u64 = 0x40000;

fn regions() -> RegionTable {
    let mut t = RegionTable::default();
    t.insert(GPU, 0x10000, MemoryKind::Device).unwrap();
    t.insert(HOST, 0x10000, MemoryKind::Host).unwrap();
    t
}

fn table(bases: &[u64], strides: &[u64], nbytes: u64, blocks: u64, kind: MemoryKind) -> BlockTable {
    let n = bases.len();
    BlockTable::new(
        bases.to_vec(),
        strides.to_vec(),
        vec![nbytes; n],
        blocks,
        kind,
        &regions(),
    )
    .unwrap()
    .named(
        if kind == MemoryKind::Device {
            "GPU"
        } else {
            "CPU"
        },
        1,
    )
}

/// A block-major host table of `segments` pages of 64 bytes (rows of `64 * segments` bytes),
/// 8 blocks from `base`: the CPU cache the staged plan needs.
fn block_major(base: u64, segments: u64) -> BlockTable {
    let bases: Vec<u64> = (0..segments).map(|s| base + 64 * s).collect();
    table(
        &bases,
        &vec![64 * segments; bases.len()],
        64,
        8,
        MemoryKind::Host,
    )
}

/// Two layers of K and V pages (64 bytes, 8 blocks) that view one GPU tensor: segments 0 and 2
/// (the K pages) are one memory, and so are 1 and 3.
fn kv_shared() -> BlockTable {
    table(
        &[GPU, GPU + 512, GPU, GPU + 512],
        &[64; 4],
        64,
        8,
        MemoryKind::Device,
    )
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Pages,
    Runs,
    Staged,
}

const KINDS: [Kind; 3] = [Kind::Pages, Kind::Runs, Kind::Staged];

/// Runs `groups` (source table, ids, destination table, ids) as one transfer by the plan `kind`:
/// its result, with the slab large enough for anything these tests write.
fn run(
    kind: Kind,
    groups: &[(&BlockTable, &[u64], &BlockTable, &[u64])],
) -> Result<Prepared, TableError> {
    let groups: Vec<Group<'_>> = groups
        .iter()
        .map(|&(src, src_ids, dst, dst_ids)| Group {
            src,
            src_ids,
            dst,
            dst_ids,
            chunks: None,
        })
        .collect();
    let runs: Vec<Vec<Run>> = groups
        .iter()
        .map(|g| block_runs(g.src, g.dst).expect("a block plan"))
        .collect();
    let rows = groups.iter().map(Group::blocks).sum();
    let host_src = groups[0].src.kind == MemoryKind::Host;
    let plan = match kind {
        Kind::Pages => Plan::Pages(true),
        Kind::Runs => Plan::Runs(&runs[..]),
        Kind::Staged => Plan::Staged(StagedExpansion {
            rows,
            blocks: rows,
            host_src,
            merge: 1 << 20,
            cells: false,
            slot: 1 << 20,
            direct: false,
        }),
    };
    let len = 4096;
    let (mut a, mut b, mut z) = (vec![0; len], vec![0; len], vec![0; len]);
    let cols = Columns {
        src: &mut a,
        dst: &mut b,
        size: &mut z,
    };
    let mut bufs = [Vec::new(), Vec::new()];
    expand_groups_into(
        &groups,
        plan,
        cols,
        &mut Scratch::default(),
        &mut bufs,
        false,
    )
}

#[test]
fn segments_that_share_memory_in_every_block_are_found_at_registration() {
    assert_eq!(kv_shared().shared_segments(), Some((0, 2)));
    assert!(!kv_shared().disjoint);
    // The same page twice, later segments: the lowest pair of the first overlap in base order.
    let t = table(
        &[GPU + 64, GPU, GPU + 64],
        &[128; 3],
        64,
        8,
        MemoryKind::Device,
    );
    assert_eq!(t.shared_segments(), Some((0, 2)));
    // A page that starts inside another one (not at its start) shares memory too.
    let t = table(&[GPU, GPU + 32], &[128; 2], 64, 8, MemoryKind::Device);
    assert_eq!(t.shared_segments(), Some((0, 1)));
    // Disjoint layouts: apart, interleaved, or pages that only touch.
    for bases in [[GPU, GPU + 1024], [GPU, GPU + 64]] {
        let t = table(&bases, &[128; 2], 64, 8, MemoryKind::Device);
        assert!(t.disjoint && t.shared_segments().is_none());
    }
    // Pages that overlap for some blocks only (two strides): not shared, checked per transfer.
    let t = some_blocks_overlap();
    assert!(!t.disjoint && t.shared_segments().is_none());
    // One block: strides do not matter.
    let t = table(&[GPU, GPU], &[64, 4096], 64, 1, MemoryKind::Device);
    assert_eq!(t.shared_segments(), Some((0, 1)));
}

#[test]
fn every_plan_refuses_to_write_a_table_whose_segments_share_memory() {
    let (host, gpu) = (block_major(HOST, 4), kv_shared());
    let want = TableError::OverlappingDestinations {
        table: "GPU".into(),
        first: (GPU + 3 * 64, 64),
        second: (GPU + 3 * 64, 64),
        within: Overlap::Segments(0, 2),
    };
    for kind in KINDS {
        // CPU -> GPU: every block written into it writes its K (and V) pages twice.
        let ids: &[u64] = &[3, 5];
        assert_eq!(
            run(kind, &[(&host, &[0, 1], &gpu, ids)]),
            Err(want.clone()),
            "{kind:?}"
        );
        assert_eq!(
            run(kind, &[(&host, &[0], &gpu, &[3])]),
            Err(want.clone()),
            "{kind:?}"
        );
        // GPU -> CPU reads each shared page twice: well-defined, and accepted.
        let p = run(kind, &[(&gpu, &[3, 5], &host, &[0, 1])]).unwrap();
        assert_eq!(p.bytes, 2 * 4 * 64, "{kind:?}");
    }
    let msg = want.to_string();
    assert!(
        msg.contains("destination pages overlap: segments 0 and 2 of the GPU table share memory"),
        "{msg}"
    );
}

/// A GPU table whose segment 1 (stride 64, from `GPU + 256`) meets segment 0 (stride 128) at
/// some blocks only: page (0, 2) is page (1, 0), and block 4's two pages are one.
fn some_blocks_overlap() -> BlockTable {
    table(&[GPU, GPU + 256], &[128, 64], 64, 8, MemoryKind::Device)
}

#[test]
fn every_plan_checks_pages_that_overlap_for_some_blocks() {
    let (host, gpu) = (block_major(HOST, 2), some_blocks_overlap());
    for kind in KINDS {
        assert!(
            run(kind, &[(&host, &[0, 1], &gpu, &[0, 1])]).is_ok(),
            "{kind:?}"
        );
        for ids in [&[0, 2][..], &[4]] {
            let src: Vec<u64> = (0..ids.len() as u64).collect();
            let e = run(kind, &[(&host, &src, &gpu, ids)]).unwrap_err();
            assert!(
                matches!(
                    e,
                    TableError::OverlappingDestinations {
                        within: Overlap::Pages,
                        ..
                    }
                ),
                "{kind:?} {ids:?}: {e}"
            );
            assert!(
                e.to_string().starts_with(
                    "destination pages of different segments of the GPU table overlap"
                ),
                "{e}"
            );
        }
        // Two groups writing it with distinct ids, blocks 0 and 2, whose pages meet: distinct
        // ids prove groups apart only on a table whose geometry proves blocks apart.
        let h1 = block_major(HOST + 0x1000, 2);
        let e = run(kind, &[(&host, &[0], &gpu, &[0]), (&h1, &[0], &gpu, &[2])]).unwrap_err();
        assert!(
            matches!(
                e,
                TableError::OverlappingDestinations {
                    within: Overlap::Groups,
                    ..
                }
            ),
            "{kind:?}: {e}"
        );
        assert!(
            run(kind, &[(&host, &[0], &gpu, &[1]), (&h1, &[0], &gpu, &[3])]).is_ok(),
            "{kind:?}"
        );
        // Read from, it is only read.
        assert!(
            run(kind, &[(&gpu, &[4, 0, 2], &host, &[0, 1, 2])]).is_ok(),
            "{kind:?}"
        );
    }
}

#[test]
fn every_plan_checks_groups_that_write_one_tensor() {
    // Two groups loading into one GPU tensor (each group a table of it): distinct blocks are
    // fine whatever the plan, the same block from both groups is refused alike.
    let gpu = table(&[GPU, GPU + 512], &[64; 2], 64, 8, MemoryKind::Device);
    let (h0, h1) = (block_major(HOST, 2), block_major(HOST + 0x1000, 2));
    for kind in KINDS {
        assert!(
            run(kind, &[(&h0, &[0], &gpu, &[1]), (&h1, &[0], &gpu, &[2])]).is_ok(),
            "{kind:?}"
        );
        let e = run(kind, &[(&h0, &[0], &gpu, &[1]), (&h1, &[3], &gpu, &[1])]).unwrap_err();
        assert_eq!(
            e,
            TableError::OverlappingDestinations {
                table: "GPU".into(),
                first: (GPU + 64, 64),
                second: (GPU + 64, 64),
                within: Overlap::Groups,
            },
            "{kind:?}"
        );
        assert!(
            e.to_string()
                .contains("destination pages of different groups overlap"),
            "{e}"
        );
        // The same with the tensor registered again for the second group (the handlers make a
        // table per group): the same geometry, proven apart by distinct ids alike.
        let again = table(&[GPU, GPU + 512], &[64; 2], 64, 8, MemoryKind::Device);
        assert!(
            run(kind, &[(&h0, &[0], &gpu, &[1]), (&h1, &[0], &again, &[2])]).is_ok(),
            "{kind:?}"
        );
        let e2 = run(kind, &[(&h0, &[0], &gpu, &[1]), (&h1, &[3], &again, &[1])]).unwrap_err();
        assert_eq!(e2, e, "{kind:?}");
        // Two groups storing into one CPU table: host rows (staged), rows or pages alike.
        let g1 = table(
            &[GPU + 0x1000, GPU + 0x1200],
            &[64; 2],
            64,
            8,
            MemoryKind::Device,
        );
        assert!(
            run(kind, &[(&gpu, &[0], &h0, &[1]), (&g1, &[0], &h0, &[2])]).is_ok(),
            "{kind:?}"
        );
        let e = run(kind, &[(&gpu, &[0], &h0, &[1]), (&g1, &[0], &h0, &[1])]).unwrap_err();
        assert!(
            matches!(
                e,
                TableError::OverlappingDestinations {
                    first: (a, _),
                    within: Overlap::Groups,
                    ..
                } if a == HOST + 128
            ),
            "{kind:?}: {e}"
        );
    }
}

#[test]
fn spans_merge_where_they_overlap_and_stay_apart_where_they_touch() {
    assert_eq!(merged_spans(vec![]), vec![]);
    // Unsorted; one range inside another; two that touch; one past the end of the rest.
    let got = merged_spans(vec![
        (5000, 24),
        (1000, 200),
        (1100, 130),
        (1230, 10),
        (1050, 10),
    ]);
    assert_eq!(got, vec![(1000, 230), (1230, 10), (5000, 24)]);
    assert_eq!(
        merged_spans(vec![(0, 10), (5, 20), (20, 10)]),
        vec![(0, 30)]
    );
}

#[test]
fn a_tensors_segments_are_disjoint_interleaved_or_apart_never_overlapping() {
    // K and V of a block side by side in one stride (kv_fused), or in regions of their own
    // (kv_split): disjoint.
    assert!(segments_disjoint(&[0, 64], &[128, 128], &[64, 64], 10));
    assert!(segments_disjoint(&[0, 1280], &[128, 128], &[128, 128], 10));
    // A V region starting inside the K region's last block, or pages wider than the gap.
    assert!(!segments_disjoint(&[0, 1200], &[128, 128], &[128, 128], 10));
    assert!(!segments_disjoint(&[0, 64], &[128, 128], &[96, 96], 10));
    // One block: only the pages of block 0 count.
    assert!(segments_disjoint(&[0, 4096], &[1, 1], &[4096, 4096], 1));
    assert!(segments_disjoint(&[], &[], &[], 3));
}
