use super::*;
use crate::plan::Plan;
use crate::region::{MemoryKind, RegionTable};
use crate::table::{expand_groups_into, Group, StagedExpansion};
use proptest::prelude::*;

/// What [`staged`] reads back from a slab: the rows used, as `(address, ring offset, bytes)`,
/// and every page, as `(ring offset, GPU address, bytes)`.
type Staged = (Vec<(u64, u64, u64)>, Vec<(u64, u64, u64)>);

/// The staged plan of `host` ids (CPU -> GPU into GPU blocks 0, 1, ...) with rows joined up to
/// `merge` bytes, read back through [`staged_pages`].
fn staged(host: &BlockTable, gpu: &BlockTable, ids: &[u64], merge: u64) -> Staged {
    let n = ids.len();
    let len = 2 * n + host.segments() + STAGED_TABLE_EXTRA;
    let (mut a, mut b, mut z) = (vec![0; len], vec![0; len], vec![0; len]);
    let gpu_ids: Vec<u64> = (0..n as u64).collect();
    let group = Group {
        src: host,
        src_ids: ids,
        dst: gpu,
        dst_ids: &gpu_ids,
        chunks: None,
    };
    let cols = Columns {
        src: &mut a,
        dst: &mut b,
        size: &mut z,
    };
    let plan = Plan::Staged(StagedExpansion {
        rows: n,
        blocks: n,
        host_src: true,
        merge,
        cells: false,
        slot: 1 << 20,
        direct: false,
    });
    let mut bufs = [Vec::new(), Vec::new()];
    let p = expand_groups_into(
        &[group],
        plan,
        cols,
        &mut Scratch::default(),
        &mut bufs,
        false,
    )
    .unwrap();
    assert_eq!((p.staged_blocks_at, p.len), (n, len));
    let rows = (0..p.staged_rows).map(|i| (a[i], b[i], z[i])).collect();
    let pages = (n..2 * n)
        .flat_map(|i| staged_pages(&a, &b, &z, i).collect::<Vec<_>>())
        .collect();
    (rows, pages)
}

#[test]
fn staged_rows_that_continue_on_the_host_join_within_a_piece_and_a_cap() {
    // A block-major host table of 8 blocks, two pages of 64 bytes each (rows of 128 bytes),
    // in a buffer registered as two pieces of 512 bytes: blocks 0-3 in one, 4-7 in the other.
    let mut r = RegionTable::default();
    r.insert(0x10000, 0x10000, MemoryKind::Device).unwrap();
    r.insert(0x40000, 512, MemoryKind::Host).unwrap();
    r.insert_piece(0x40200, 512, MemoryKind::Host).unwrap();
    let host = BlockTable::new(
        vec![0x40000, 0x40040],
        vec![128, 128],
        vec![64, 64],
        8,
        MemoryKind::Host,
        &r,
    )
    .unwrap();
    let gpu = BlockTable::new(
        vec![0x10000, 0x18000],
        vec![64, 64],
        vec![64, 64],
        8,
        MemoryKind::Device,
        &r,
    )
    .unwrap();
    let row = |b: u64| 0x40000 + 128 * b;
    // Blocks 1, 2, 3 then 4, 5 and 0: one row for 1-3 (a seam at block 4's start), one for
    // 4-5, one for 0; ring offsets one after the other.
    let ids = [1, 2, 3, 4, 5, 0];
    let (rows, pages) = staged(&host, &gpu, &ids, 1 << 20);
    assert_eq!(
        rows,
        [(row(1), 0, 384), (row(4), 384, 256), (row(0), 640, 128)]
    );
    // Every GPU page reads the host bytes it would without joining, in the order given: GPU
    // block k takes host block ids[k], K then V.
    let given = same_pages_unjoined(&host, &gpu, &ids, &rows, &pages);
    assert_eq!(given.len(), 12);
    assert_eq!(given[0], (row(1), 0x10000, 64));
    assert_eq!(given[1], (row(1) + 64, 0x18000, 64));
    assert_eq!(given[11], (row(0) + 64, 0x18000 + 5 * 64, 64));
    // A cap of 256 bytes: two rows at most joined.
    let (rows, _) = staged(&host, &gpu, &[0, 1, 2, 3], 256);
    assert_eq!(rows, [(row(0), 0, 256), (row(2), 256, 256)]);
    // Ids counting down join as those counting up do (vLLM hands a request the chunks one
    // eviction freed in reverse), run by run, and their pages still go to their own blocks;
    // adjacent ids apart in the list do not join; with no merging asked for, nothing joins.
    let ids = [3, 2, 1, 7, 6, 0];
    let (rows, pages) = staged(&host, &gpu, &ids, 1 << 20);
    assert_eq!(
        rows,
        [(row(1), 0, 384), (row(6), 384, 256), (row(0), 640, 128)]
    );
    same_pages_unjoined(&host, &gpu, &ids, &rows, &pages);
    let (rows, _) = staged(&host, &gpu, &[0, 2, 1], 1 << 20);
    assert_eq!(rows, [(row(0), 0, 384)]); // 2, 1 taken as 1, 2: after 0
    let (rows, _) = staged(&host, &gpu, &[1, 5, 2], 1 << 20);
    assert_eq!(rows.len(), 3);
    let (rows, _) = staged(&host, &gpu, &[2, 1, 0], 0);
    assert_eq!(
        rows,
        [(row(2), 0, 128), (row(1), 128, 128), (row(0), 256, 128)]
    );
}

#[test]
fn descending_runs_are_reversed_in_place_and_nothing_else_moves() {
    let ids = |p: &[(u64, u64)]| p.iter().map(|&(h, _)| h).collect::<Vec<_>>();
    let mut p: Vec<(u64, u64)> = [5, 4, 3, 9, 1, 2, 8, 7, 0]
        .iter()
        .enumerate()
        .map(|(i, &h)| (h, i as u64))
        .collect();
    reverse_descents(&mut p);
    assert_eq!(ids(&p), [3, 4, 5, 9, 1, 2, 7, 8, 0]);
    // Each GPU id stays with its host id.
    assert_eq!(p[0], (3, 2));
    assert_eq!(p[6], (7, 7));
    let mut empty: [(u64, u64); 0] = [];
    reverse_descents(&mut empty);
    let mut zero = [(0, 0), (u64::MAX, 1)];
    reverse_descents(&mut zero);
    assert_eq!(zero, [(0, 0), (u64::MAX, 1)]);
}

/// Checks that the pages of `ids` staged with joined `rows` read the same host bytes into the
/// same GPU bytes as with no row joined, and returns the latter's pages in the order given, as
/// [`host_pages`] names them.
fn same_pages_unjoined(
    host: &BlockTable,
    gpu: &BlockTable,
    ids: &[u64],
    rows: &[(u64, u64, u64)],
    pages: &[(u64, u64, u64)],
) -> Vec<(u64, u64, u64)> {
    let (unjoined_rows, unjoined) = staged(host, gpu, ids, 0);
    let given = host_pages(&unjoined_rows, &unjoined);
    let mut joined = host_pages(rows, pages);
    let mut sorted = given.clone();
    joined.sort_unstable();
    sorted.sort_unstable();
    assert_eq!(joined, sorted);
    given
}

/// Each page of [`staged`] as `(host address, GPU address, bytes)`: its ring offset read
/// through the row that put those bytes in the ring.
fn host_pages(rows: &[(u64, u64, u64)], pages: &[(u64, u64, u64)]) -> Vec<(u64, u64, u64)> {
    pages
        .iter()
        .map(|&(ring, gpu, bytes)| {
            let &(addr, at, _) = rows
                .iter()
                .find(|&&(_, at, len)| at <= ring && ring + bytes <= at + len)
                .expect("a row holds every page");
            (addr + ring - at, gpu, bytes)
        })
        .collect()
}

#[test]
fn a_slab_holds_a_word_per_block_and_one_geometry_per_group_not_a_descriptor_per_page() {
    // Pages of different sizes (K 64 bytes, V 32), GPU segments at their own strides.
    let mut r = RegionTable::default();
    r.insert(0x10000, 0x10000, MemoryKind::Device).unwrap();
    r.insert(0x40000, 0x1000, MemoryKind::Host).unwrap();
    let host = BlockTable::new(
        vec![0x40000, 0x40040],
        vec![96, 96],
        vec![64, 32],
        8,
        MemoryKind::Host,
        &r,
    )
    .unwrap();
    let gpu = BlockTable::new(
        vec![0x10000, 0x14000],
        vec![256, 32],
        vec![64, 32],
        8,
        MemoryKind::Device,
        &r,
    )
    .unwrap();
    let (_, pages) = staged(&host, &gpu, &[6, 2], 0);
    assert_eq!(
        pages,
        [
            (0, 0x10000, 64),
            (64, 0x14000, 32),
            (96, 0x10000 + 256, 64),
            (96 + 64, 0x14000 + 32, 32),
        ]
    );
    // The geometry, as the module says: a header, a segment each, the row's end.
    let (mut a, mut b, mut z) = (vec![0; 8], vec![0; 8], vec![0; 8]);
    let mut cursor = StagedCursor::new(2, 2, 0);
    let cols = Columns {
        src: &mut a,
        dst: &mut b,
        size: &mut z,
    };
    let p = expand_staged_into(
        Pair {
            src: &host,
            src_ids: &[6, 2],
            dst: &gpu,
            dst_ids: &[0, 1],
        },
        true,
        cols,
        &mut cursor,
        &mut Scratch::default(),
    )
    .unwrap();
    assert_eq!((p.len, p.bytes, p.max_size, p.staged_rows), (2, 192, 64, 2));
    assert_eq!(&a[2..4], [0, 1]);
    assert_eq!(&b[2..4], [0, 96]);
    assert_eq!(&z[2..4], [4, 4]);
    assert_eq!(&a[4..8], [2, 0x10000, 0x14000, 0]);
    assert_eq!(&b[4..8], [0, 256, 32, 0]);
    assert_eq!(&z[4..8], [96, 0, 64, 96]);
    assert_eq!((cursor.row, cursor.block, cursor.table), (2, 4, 8));
}

#[test]
fn staged_steps_take_whole_rows_within_a_slot() {
    // 10 rows of 3 blocks, 96 bytes a row (blocks of 32 bytes).
    let rows: Vec<u64> = (0..10).map(|i| i * 96).collect();
    let bytes = vec![96u64; 10];
    let blocks: Vec<u64> = (0..30).map(|p| p * 32).collect();
    let ends: Vec<u64> = blocks.iter().map(|b| b + 32).collect();
    for (slot, behind) in [96u64, 100, 200, 288, 1 << 20]
        .into_iter()
        .flat_map(|s| [(s, false), (s, true)])
    {
        // A step of one byte or more: full steps whatever the transfer's size.
        let steps = staged_steps(&rows, &bytes, &blocks, &ends, slot, 1, behind);
        // Every row and block once, in order; each step within a slot.
        let (mut r, mut p) = (0, 0);
        for s in &steps {
            assert_eq!((s.rows.start, s.blocks.start), (r, p));
            assert_eq!(s.ring_start, rows[s.rows.start]);
            assert_eq!(s.blocks.len(), 3 * s.rows.len());
            assert!(96 * s.rows.len() as u64 <= slot, "{s:?} in {slot}");
            (r, p) = (s.rows.end, s.blocks.end);
        }
        assert_eq!((r, p), (10, 30));
        // Full steps of at most a quarter of the rows, fewer where the slot says; a ramp of
        // a quarter of that (at least a row) first and last, none behind a running transfer.
        let per = (slot / 96).min(10usize.div_ceil(STAGED_FULL_STEPS) as u64) as usize;
        let ramp = 10usize.div_ceil(STAGED_FULL_STEPS).div_ceil(STAGED_RAMP);
        assert!(steps.iter().all(|s| s.rows.len() <= per), "slot {slot}");
        if behind {
            assert_eq!(steps.len(), 10usize.div_ceil(per), "slot {slot}: {steps:?}");
        } else {
            assert!(steps[0].rows.len() <= ramp, "slot {slot}: {steps:?}");
            assert!(
                steps[steps.len() - 1].rows.len() <= ramp,
                "slot {slot}: {steps:?}"
            );
            assert!(
                steps.len() <= 10usize.div_ceil(per) + 2,
                "slot {slot}: {steps:?}"
            );
        }
    }
    // 32 rows: a ramp of 2 rows, full steps of 8, the rest, a ramp of 2.
    let rows: Vec<u64> = (0..32).map(|i| i * 96).collect();
    let blocks: Vec<u64> = (0..96).map(|p| p * 32).collect();
    let ends: Vec<u64> = blocks.iter().map(|b| b + 32).collect();
    let steps = staged_steps(&rows, &[96; 32], &blocks, &ends, 1 << 20, 1, false);
    let lens: Vec<usize> = steps.iter().map(|s| s.rows.len()).collect();
    assert_eq!(lens, [2, 8, 8, 8, 4, 2]);
    // Behind a running transfer: the same full steps, no ramp; a slot of 6 rows cuts them at 6.
    let lens = |slot| -> Vec<usize> {
        staged_steps(&rows, &[96; 32], &blocks, &ends, slot, 1, true)
            .iter()
            .map(|s| s.rows.len())
            .collect()
    };
    assert_eq!(lens(1 << 20), [8, 8, 8, 8]);
    assert_eq!(lens(6 * 96), [6, 6, 6, 6, 6, 2]);
}

#[test]
fn behind_a_running_transfer_a_small_one_takes_fewer_full_steps() {
    // 32 rows of 96 bytes: 3,072 bytes.
    let rows: Vec<u64> = (0..32).map(|i| i * 96).collect();
    let blocks: Vec<u64> = (0..96).map(|p| p * 32).collect();
    let ends: Vec<u64> = blocks.iter().map(|b| b + 32).collect();
    let lens = |step, behind| -> Vec<usize> {
        staged_steps(&rows, &[96; 32], &blocks, &ends, 1 << 20, step, behind)
            .iter()
            .map(|s| s.rows.len())
            .collect()
    };
    // Less than two steps' bytes: one step; two and three full steps; four at most, however
    // small a step may be.
    for step in [3072, 1 << 20, 1537] {
        assert_eq!(lens(step, true), [32], "{step}");
    }
    assert_eq!(lens(1536, true), [16, 16]);
    assert_eq!(lens(1024, true), [11, 11, 10]);
    assert_eq!(lens(768, true), [8, 8, 8, 8]);
    assert_eq!(lens(1, true), [8, 8, 8, 8]);
    // An isolated transfer keeps its full steps and its ramps, whatever its size.
    for step in [1, 1536, 1 << 20] {
        assert_eq!(lens(step, false), [2, 8, 8, 8, 4, 2], "{step}");
    }
    assert_eq!(staged_full_steps(0, 1 << 20), 1);
    assert_eq!(staged_full_steps(u64::MAX, 0), STAGED_FULL_STEPS);
    assert_eq!(
        staged_full_steps(3 * STAGED_STEP_BYTES - 1, STAGED_STEP_BYTES),
        2
    );
}

/// Two tensors of 64-byte pages, two blocks per chunk, in cells of 256 bytes: group `j`'s host
/// table holds each tensor's `j`-th page of a chunk (vLLM's offload region), holes between them;
/// both groups share the GPU tensors.
fn cells() -> (BlockTable, BlockTable, BlockTable) {
    cells_with(0x80)
}

/// [`cells`] with the second tensor's pages `second` bytes into a cell.
fn cells_with(second: u64) -> (BlockTable, BlockTable, BlockTable) {
    let mut r = RegionTable::default();
    r.insert(0x10000, 0x10000, MemoryKind::Device).unwrap();
    r.insert(0x40000, 0x1000, MemoryKind::Host).unwrap();
    let host = |j: u64| {
        BlockTable::new(
            vec![0x40000 + 64 * j, 0x40000 + second + 64 * j],
            vec![256, 256],
            vec![64, 64],
            4,
            MemoryKind::Host,
            &r,
        )
        .unwrap()
        .named("CPU", 1)
    };
    let gpu = BlockTable::new(
        vec![0x10000, 0x11000],
        vec![64, 64],
        vec![64, 64],
        16,
        MemoryKind::Device,
        &r,
    )
    .unwrap();
    (host(0), host(1), gpu)
}

/// A store of `groups` (host table, GPU ids, chunk ids) on the cell plan with slots of `slot`.
fn store_cells(
    groups: &[(&BlockTable, &[u64], &[u64])],
    gpu: &BlockTable,
    slot: Option<u64>,
) -> Result<(Prepared, [Vec<u64>; 3]), TableError> {
    let blocks: usize = groups.iter().map(|g| g.1.len()).sum();
    let rows = if slot.is_some() { 2 * blocks } else { 0 };
    let len = rows + blocks + groups.len() * (2 * 2 + STAGED_TABLE_EXTRA);
    let (mut a, mut b, mut z) = (vec![0; len], vec![0; len], vec![0; len]);
    let gs: Vec<Group<'_>> = groups
        .iter()
        .map(|&(host, g, c)| Group {
            src: gpu,
            src_ids: g,
            dst: host,
            dst_ids: c,
            chunks: None,
        })
        .collect();
    let plan = Plan::Staged(StagedExpansion {
        rows,
        blocks,
        host_src: false,
        merge: 1 << 20,
        cells: true,
        slot: slot.unwrap_or(0),
        direct: slot.is_none(),
    });
    let cols = Columns {
        src: &mut a,
        dst: &mut b,
        size: &mut z,
    };
    let mut bufs = [Vec::new(), Vec::new()];
    let p = expand_groups_into(&gs, plan, cols, &mut Scratch::default(), &mut bufs, false)?;
    Ok((p, [a, b, z]))
}

#[test]
fn a_cell_with_holes_is_staged_as_one_cluster_whose_rows_are_the_pages_owned() {
    let (h0, h1, gpu) = cells();
    assert_eq!(staged_cell(&h0), Some((192, true)));
    assert_eq!(staged_row(&h0), None);
    assert_eq!(staged_fit(&h1, 192), Ok((192, true)));
    // The two sub-blocks' tables fill each other's holes: a cell of 256 bytes; one alone does
    // not (the other's pages are not its cache's).
    assert_eq!(staged_cells(&[&h0, &h1]), Ok(Some(256)));
    assert!(staged_cells(&[&h0]).unwrap_err().contains("bytes 64..128"));
    assert_eq!(staged_cells(&[&gpu]), Ok(None));
    // Chunk 2 whole (sub-block 0 from GPU block 3, sub-block 1 from block 4), chunk 0's
    // sub-block 0 only (from block 5): its sub-block 1 is not this store's to write.
    let (p, [a, b, z]) = store_cells(
        &[(&h0, &[3, 5], &[2, 0]), (&h1, &[4], &[2])],
        &gpu,
        Some(256),
    )
    .unwrap();
    let (n_rows, at) = (p.staged_rows, p.staged_blocks_at);
    assert_eq!((at, p.staged_blocks, p.bytes), (6, 3, 3 * 128));
    let rows: Vec<_> = (0..n_rows).map(|i| (a[i], b[i], z[i])).collect();
    // Chunk 0 first (host order): its two pages, the hole between them kept in the ring; then
    // chunk 2's whole cell as one row.
    assert_eq!(
        rows,
        [(0x40000, 0, 64), (0x40080, 128, 64), (0x40200, 192, 256)]
    );
    // Block entries in ring order, one geometry for both groups: a page, a hole, a page. Its
    // header names the pages' tile: pages of one size, each 128 bytes after the one before.
    assert_eq!(&a[at..at + 3], [5, 3, 4]);
    assert_eq!(&b[at..at + 3], [0, 192, 256]);
    assert!(z[at..at + 3].iter().all(|&t| t == z[at]));
    let t = z[at] as usize;
    assert_eq!((a[t], b[t], z[t]), (3, 128, 128));
    assert_eq!(p.len, at + 3 + 3 + STAGED_TABLE_EXTRA);
    let pages: Vec<_> = (at..at + 3)
        .flat_map(|i| staged_pages(&a, &b, &z, i).collect::<Vec<_>>())
        .collect();
    let g = |t: u64, id: u64| 0x10000 + 0x1000 * t + 64 * id;
    assert_eq!(
        pages,
        [
            (0, g(0, 5), 64),
            (128, g(1, 5), 64),
            (192, g(0, 3), 64),
            (320, g(1, 3), 64),
            (256, g(0, 4), 64),
            (384, g(1, 4), 64),
        ]
    );
    // Every page's ring bytes lie where its host bytes lie in its cluster's rows.
    for &(ring, _, n) in &pages {
        assert!(rows.iter().any(|&(_, r, m)| r <= ring && ring + n <= r + m));
    }
    // The steps keep a cluster whole even one row at a time: chunk 0's two rows together.
    let ends: Vec<u64> = (at..at + 3).map(|i| b[i] + 192).collect();
    let steps = staged_steps(&b[..3], &z[..3], &b[at..at + 3], &ends, 256, 1, false);
    assert_eq!(
        steps.iter().map(|s| s.rows.clone()).collect::<Vec<_>>(),
        [0..2, 2..3]
    );
    assert_eq!(steps[1].blocks, 1..3);
}

#[test]
fn a_store_into_sub_blocks_that_share_pages_is_refused_naming_two_pages() {
    // Sub-block tables 64 bytes apart whose pages are 64 bytes apart too: sub-block 0's second
    // page is sub-block 1's first. Both blocks of chunk 2 lie a page apart, so each segment's
    // pages are joined as one run first; the runs overlap, and the error names the two pages
    // that share bytes, as a check of every page does.
    let (h0, h1, gpu) = cells_with(0x40);
    for slot in [Some(256), None] {
        let e = store_cells(&[(&h0, &[3], &[2]), (&h1, &[4], &[2])], &gpu, slot).unwrap_err();
        assert_eq!(
            e,
            TableError::OverlappingDestinations {
                table: "CPU".into(),
                first: (0x40240, 64),
                second: (0x40240, 64),
                within: Overlap::Groups,
            },
            "{slot:?}"
        );
    }
}

#[test]
fn the_cell_plan_refuses_a_store_writing_a_page_twice_and_a_cell_past_a_slot_direct_or_not() {
    let (h0, h1, gpu) = cells();
    // Sub-block 0 of chunk 1 from two groups: the same host bytes written twice.
    let e = store_cells(&[(&h0, &[1], &[1]), (&h0, &[2], &[1])], &gpu, Some(256)).unwrap_err();
    assert!(
        matches!(e, TableError::OverlappingDestinations { .. }),
        "{e}"
    );
    // A whole cell is 256 bytes: slots of 200 cannot hold it, one block's span (192) fits.
    let e = store_cells(&[(&h0, &[1], &[1]), (&h1, &[2], &[1])], &gpu, Some(200)).unwrap_err();
    assert!(e.to_string().contains("more than a staging slot"), "{e}");
    assert!(store_cells(&[(&h0, &[1], &[1])], &gpu, Some(200)).is_ok());
    // The direct plan refuses the same store, and has no slot to outgrow.
    let e = store_cells(&[(&h0, &[1], &[1]), (&h0, &[2], &[1])], &gpu, None).unwrap_err();
    assert!(
        matches!(e, TableError::OverlappingDestinations { .. }),
        "{e}"
    );
    let (p, _) = store_cells(&[(&h0, &[1], &[1]), (&h1, &[2], &[1])], &gpu, None).unwrap();
    assert_eq!((p.staged_rows, p.staged_blocks), (0, 2));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 2 } else { 128 }))]

    /// The cell plan on random cells (tensors of their own page sizes, 1-4 sub-blocks a chunk,
    /// padding at the row's end) and random stores or loads of some sub-blocks of some chunks:
    /// the rows are exactly the host bytes of the pages moved; every page's ring bytes lie in a
    /// row of the step that moves its block, at the offset of its host page in that row; steps
    /// fit a slot. The direct plan on the same cells: no row, every page's ring side its host
    /// page, each wanted page named once, launches of at most `launch_bytes` of pages (or one
    /// block).
    #[test]
    fn the_cell_plan_moves_exactly_the_pages_of_its_blocks(
        direct in any::<bool>(),
        f in 1u64..5,
        pages in proptest::collection::vec((1u64..5).prop_map(|k| 16 * k), 1..5),
        pad in 0u64..3,
        picks in proptest::collection::vec(any::<bool>(), 24),
        extra in 0u64..3,
        store in any::<bool>(),
    ) {
        const CHUNKS: u64 = 6;
        let cell: u64 = pages.iter().map(|p| f * p).sum();
        let stride = cell + 16 * pad;
        let mut r = RegionTable::default();
        r.insert(0x100000, 0x100000, MemoryKind::Device).unwrap();
        r.insert(0x40000, stride * CHUNKS, MemoryKind::Host).unwrap();
        let offsets: Vec<u64> = (0..pages.len())
            .map(|t| pages[..t].iter().map(|p| f * p).sum())
            .collect();
        let hosts: Vec<BlockTable> = (0..f)
            .map(|j| {
                let bases = (0..pages.len()).map(|t| 0x40000 + offsets[t] + j * pages[t]).collect();
                BlockTable::new(bases, vec![stride; pages.len()], pages.clone(), CHUNKS,
                                MemoryKind::Host, &r).unwrap()
            })
            .collect();
        let gpu_base = |t: usize| 0x100000 + 0x8000 * t as u64;
        let gpu = BlockTable::new((0..pages.len()).map(gpu_base).collect(), pages.clone(),
                                  pages.clone(), 32, MemoryKind::Device, &r).unwrap();
        // Sub-block j of chunk c moves when picked, to or from GPU block c * f + j.
        let mut ids: Vec<(Vec<u64>, Vec<u64>)> = vec![(Vec::new(), Vec::new()); f as usize];
        for c in 0..CHUNKS {
            for j in 0..f {
                if picks[(c * 4 + j) as usize % picks.len()] {
                    ids[j as usize].0.push(c * f + j);
                    ids[j as usize].1.push(c);
                }
            }
        }
        prop_assume!(ids.iter().any(|g| !g.0.is_empty()));
        let groups: Vec<Group<'_>> = ids
            .iter()
            .zip(&hosts)
            .map(|((g, c), host)| if store {
                Group { src: &gpu, src_ids: g, dst: host, dst_ids: c, chunks: None }
            } else {
                Group { src: host, src_ids: c, dst: &gpu, dst_ids: g, chunks: None }
            })
            .collect();
        let blocks: usize = ids.iter().map(|g| g.0.len()).sum();
        let rows = if direct { 0 } else { blocks * pages.len() };
        let len = rows + blocks + f as usize * (2 * pages.len() + STAGED_TABLE_EXTRA);
        let slot = cell + extra * cell / 2;
        let (mut a, mut b, mut z) = (vec![0; len], vec![0; len], vec![0; len]);
        let plan = Plan::Staged(StagedExpansion {
            rows, blocks, host_src: !store, merge: 1 << 20, cells: true, slot, direct,
        });
        let cols = Columns { src: &mut a, dst: &mut b, size: &mut z };
        let p = expand_groups_into(&groups, plan, cols, &mut Scratch::default(),
                                   &mut [Vec::new(), Vec::new()], false).unwrap();
        prop_assert_eq!(p.staged_blocks, blocks);
        // The host page of every GPU page moved.
        let mut want = std::collections::HashMap::new();
        for (j, (g, c)) in ids.iter().enumerate() {
            for (&id, &chunk) in g.iter().zip(c) {
                for t in 0..pages.len() {
                    let host = 0x40000 + chunk * stride + offsets[t] + j as u64 * pages[t];
                    want.insert(gpu_base(t) + id * pages[t], (host, pages[t]));
                }
            }
        }
        if direct {
            prop_assert_eq!((p.staged_rows, p.staged_blocks_at), (0, 0));
            let req = StagedRequest { rows: 0, first_block: 0, blocks, slot_bytes: slot,
                                      step_bytes: STAGED_STEP_BYTES, kernel: None, direct: true,
                                      launch_bytes: slot };
            let steps = req.steps(&a, &b, &z, false);
            let mut named = std::collections::HashMap::new();
            let mut next = 0;
            for step in &steps {
                prop_assert_eq!(step.blocks.start, next);
                next = step.blocks.end;
                // Page bytes, holes not counted, at most launch_bytes a launch.
                let moved: u64 = step.blocks.clone()
                    .flat_map(|i| staged_pages(&a, &b, &z, i).map(|(_, _, n)| n))
                    .sum();
                prop_assert!(step.blocks.len() == 1 || moved <= slot);
                // And no launch ends early: the next block would not have fitted.
                if step.blocks.end < blocks {
                    let next: u64 = staged_pages(&a, &b, &z, step.blocks.end)
                        .map(|(_, _, n)| n)
                        .sum();
                    prop_assert!(moved + next > slot);
                }
                for i in step.blocks.clone() {
                    for (host, gpu_page, n) in staged_pages(&a, &b, &z, i) {
                        prop_assert!(named.insert(gpu_page, (host, n)).is_none());
                    }
                }
            }
            prop_assert_eq!(next, blocks);
            prop_assert_eq!(named, want);
            return Ok(());
        }
        let row_list: Vec<(u64, u64, u64)> = (0..p.staged_rows).map(|i| (a[i], b[i], z[i])).collect();
        // Rows: exactly the host bytes of the pages, in no particular grouping.
        let merge = |mut v: Vec<(u64, u64)>| {
            v.sort_unstable();
            let mut out: Vec<(u64, u64)> = Vec::new();
            for (s, e) in v {
                match out.last_mut() {
                    Some(last) if s <= last.1 => last.1 = last.1.max(e),
                    _ => out.push((s, e)),
                }
            }
            out
        };
        let row_bytes: u64 = row_list.iter().map(|r| r.2).sum();
        let page_bytes: u64 = want.values().map(|&(_, n)| n).sum();
        prop_assert_eq!(row_bytes, page_bytes);
        prop_assert_eq!(
            merge(row_list.iter().map(|&(h, _, n)| (h, h + n)).collect()),
            merge(want.values().map(|&(h, n)| (h, h + n)).collect())
        );
        let req = StagedRequest { rows: p.staged_rows, first_block: p.staged_blocks_at, blocks,
                                  slot_bytes: slot, step_bytes: 1 << (slot % 12),
                                  kernel: None, direct: false, launch_bytes: u64::MAX };
        for behind in [false, true] {
            let steps = req.steps(&a, &b, &z, behind);
            let mut seen = 0;
            for step in &steps {
                let (lo, last) = (b[step.rows.start], step.rows.end - 1);
                prop_assert!(b[last] + z[last] - lo <= slot);
                prop_assert_eq!(step.ring_start, lo);
                seen += step.blocks.len();
                for i in step.blocks.clone() {
                    for (ring, gpu_page, n) in staged_pages(&a, &b, &z, p.staged_blocks_at + i) {
                        let row = row_list[step.rows.clone()]
                            .iter()
                            .find(|&&(_, r, m)| r <= ring && ring + n <= r + m);
                        prop_assert!(row.is_some(), "page at ring {} outside its step", ring);
                        let &(h, r, _) = row.unwrap();
                        prop_assert_eq!(want.get(&gpu_page).copied(), Some((h + (ring - r), n)));
                    }
                }
            }
            prop_assert_eq!(seen, blocks);
        }
    }
}
