use super::*;
use crate::plan::Plan;

fn regions() -> RegionTable {
    let mut t = RegionTable::default();
    t.insert(0x10000, 0x10000, MemoryKind::Device).unwrap();
    t.insert(0x40000, 0x10000, MemoryKind::Host).unwrap();
    t
}

/// One segment of 64-byte pages at a 64-byte stride: `blocks` blocks from `base`.
fn flat(base: u64, blocks: u64, kind: MemoryKind) -> BlockTable {
    BlockTable::new(vec![base], vec![64], vec![64], blocks, kind, &regions()).unwrap()
}

fn chunked(c: &[u64], unit: u64, chunks: u64, blocks: usize, skip: u64) -> Vec<u64> {
    let t = flat(0x40000, chunks * unit, MemoryKind::Host).named("CPU", unit);
    let g = flat(0x10000, 8, MemoryKind::Device).named("GPU", 1);
    let mut out = vec![99];
    chunk_blocks(&t, Side::Dst, &g, c, blocks, skip, &mut out).unwrap();
    out
}

#[test]
fn chunk_ids_name_consecutive_sub_blocks_from_the_skip() {
    assert_eq!(
        chunked(&[0, 1, 3], 4, 4, 12, 0),
        [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15]
    );
    // Partial first and last chunk.
    assert_eq!(
        chunked(&[0, 1, 3], 4, 4, 9, 1),
        [1, 2, 3, 4, 5, 6, 7, 12, 13]
    );
    assert_eq!(chunked(&[3], 4, 4, 1, 2), [14]);
    // End-aligned onload of 6 blocks from 2 chunks: skip (-6) mod 4 = 2.
    assert_eq!(chunked(&[3, 1], 4, 4, 6, 2), [14, 15, 4, 5, 6, 7]);
    assert_eq!(chunked(&[], 4, 4, 0, 3), Vec::<u64>::new());
    assert_eq!(chunked(&[2, 0], 1, 4, 2, 0), [2, 0]);
}

#[test]
fn bad_chunk_ids_are_refused_by_name() {
    let t = flat(0x40000, 16, MemoryKind::Host).named("CPU", 4);
    let g = flat(0x10000, 8, MemoryKind::Device).named("GPU", 1);
    let mut out = Vec::new();
    let err = |c: &[u64], blocks, skip| {
        chunk_blocks(&t, Side::Dst, &g, c, blocks, skip, &mut Vec::new())
            .unwrap_err()
            .to_string()
    };
    let e = err(&[0, 1], 9, 0);
    assert!(
        e.contains("ceil((0 + 9) / 4) = 3 CPU block ids") && e.contains("got 2"),
        "{e}"
    );
    let e = err(&[0, 1, 2], 5, 0);
    assert!(
        e.contains("= 2 CPU block ids") && e.contains("got 3"),
        "{e}"
    );
    // A partial last chunk from a skip: 3 + 2 sub-blocks span two chunks.
    let e = err(&[0], 2, 3);
    assert!(
        e.contains("ceil((3 + 2) / 4) = 2 CPU block ids") && e.contains("got 1"),
        "{e}"
    );
    assert!(err(&[0], 1, 4).contains("skip must be below 4"));
    // Checked before scaling: a huge chunk id must not wrap into a valid block.
    let huge = (u64::MAX / 4) + 1;
    assert!(err(&[huge], 1, 0).contains("out of range"));
    assert!(err(&[4], 1, 0).contains("there are 4 blocks"));
    assert!(err(&[(-1i64) as u64], 1, 0).contains("negative block id (-1"));
    assert!(chunk_blocks(&t, Side::Dst, &g, &[3, 1, 0], 9, 3, &mut out).is_ok());
}

fn run(groups: &[Group<'_>]) -> Result<Vec<(u64, u64, u64)>, TableError> {
    let n: usize = groups
        .iter()
        .map(|g| g.src.segments() * g.blocks())
        .sum::<usize>();
    let (mut a, mut b, mut z) = (vec![0; n], vec![0; n], vec![0; n]);
    let p = expand_groups_into(
        groups,
        Plan::Pages(false),
        Columns {
            src: &mut a,
            dst: &mut b,
            size: &mut z,
        },
        &mut Scratch::default(),
        &mut [Vec::new(), Vec::new()],
        false,
    )?;
    Ok((0..p.len).map(|i| (a[i], b[i], z[i])).collect())
}

#[test]
fn groups_go_one_after_another_with_chunk_ids_on_the_cpu_side() {
    let (g0, g1) = (
        flat(0x10000, 8, MemoryKind::Device),
        flat(0x12000, 8, MemoryKind::Device),
    );
    let (c0, c1) = (
        flat(0x40000, 8, MemoryKind::Host).named("CPU", 2),
        flat(0x42000, 8, MemoryKind::Host).named("CPU", 2),
    );
    let group = |src, src_ids, dst, dst_ids, chunks| Group {
        src,
        src_ids,
        dst,
        dst_ids,
        chunks,
    };
    // Offload: group 0 three blocks into chunks 3, 1 from sub-block 1; group 1 empty; group
    // 2 (group 0's tables again, other blocks) one block.
    let got = run(&[
        group(&g0, &[5, 6, 7], &c0, &[3, 1], Some(1)),
        group(&g1, &[], &c1, &[], Some(0)),
        group(&g1, &[2], &c1, &[0], Some(0)),
    ])
    .unwrap();
    let page = |t: &BlockTable, b: u64| t.bases[0] + 64 * b;
    assert_eq!(
        got,
        [
            (page(&g0, 5), page(&c0, 7), 64),
            (page(&g0, 6), page(&c0, 2), 64),
            (page(&g0, 7), page(&c0, 3), 64),
            (page(&g1, 2), page(&c1, 0), 64),
        ]
    );
    // Onload, chunked source.
    let got = run(&[group(&c0, &[2], &g0, &[0, 4], Some(0))]).unwrap();
    assert_eq!(
        got,
        [
            (page(&c0, 4), page(&g0, 0), 64),
            (page(&c0, 5), page(&g0, 4), 64)
        ]
    );

    // Errors name the group, and a repeated chunk by its position among the chunk ids.
    let e = run(&[
        group(&g0, &[0], &c0, &[0], Some(0)),
        group(&g1, &[0, 1, 2], &c1, &[1, 1], Some(0)),
    ])
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with(
            "group 1: CPU block id 1 is a destination more than once (again at position 1)"
        ),
        "{e}"
    );
    let e = run(&[group(&g0, &[0, 1], &c0, &[0], Some(1))])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("= 2 CPU block ids") && e.contains("got 1"),
        "{e}"
    );
    let e = run(&[group(&g0, &[0], &g1, &[0], Some(1))])
        .unwrap_err()
        .to_string();
    assert!(e.contains("neither table counts chunks"), "{e}");
    let e = run(&[group(&c0, &[0], &c1, &[0], Some(0))])
        .unwrap_err()
        .to_string();
    assert!(e.contains("both tables count chunks"), "{e}");
    assert_eq!(
        run(&[
            group(&g0, &[], &c0, &[], Some(0)),
            group(&g1, &[], &c1, &[], Some(0))
        ]),
        Err(TableError::Empty)
    );
    assert_eq!(
        run(&[group(&g0, &[], &c0, &[], Some(0))]),
        Err(TableError::Empty)
    );
}

#[test]
fn groups_sharing_a_destination_table_are_checked_across_groups() {
    let (g0, g1) = (
        flat(0x10000, 8, MemoryKind::Device),
        flat(0x12000, 8, MemoryKind::Device),
    );
    let c = flat(0x40000, 8, MemoryKind::Host);
    let group = |src, src_ids, dst_ids| Group {
        src,
        src_ids,
        dst: &c,
        dst_ids,
        chunks: None,
    };
    // Distinct blocks of one table from two groups: fine; the same block twice: refused.
    assert_eq!(
        run(&[group(&g0, &[0], &[1]), group(&g1, &[0], &[2])])
            .unwrap()
            .len(),
        2
    );
    let e = run(&[group(&g0, &[0], &[1]), group(&g1, &[0], &[1])])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("destination pages of different groups overlap"),
        "{e}"
    );
}

#[test]
fn the_skip_and_count_rule_of_chunked_transfers() {
    // With the first block's index in its request: that many sub-blocks into the first chunk.
    assert_eq!(chunk_skip(4, 6, Some(9), true), 1);
    assert_eq!(chunk_skip(4, 6, Some(9), false), 1);
    // Without it, stores start at a chunk's start and loads end at a chunk's end.
    assert_eq!(chunk_skip(4, 6, None, true), 0);
    assert_eq!(chunk_skip(4, 6, None, false), 2);
    assert_eq!(chunk_skip(4, 8, None, false), 0);
    assert_eq!(chunk_skip(1, 5, None, false), 0);
    assert_eq!(chunk_count(4, 6, 2), 2);
    assert_eq!(chunk_count(4, 6, 3), 3);
    assert_eq!(chunk_count(4, 1, 3), 1);
    assert_eq!(chunk_count(4, 0, 3), 0);
    // The rule the mapping keeps: what chunk_count names is what map_chunks takes.
    let mut out = Vec::new();
    for (blocks, skip) in [(6u64, 2u64), (6, 3), (1, 3), (9, 0)] {
        let n = chunk_count(4, blocks, skip) as usize;
        let chunks: Vec<u64> = (0..n as u64).collect();
        map_chunks(
            ["CPU", "GPU"],
            4,
            8,
            &chunks,
            blocks as usize,
            skip,
            &mut out,
        )
        .unwrap();
        assert_eq!(out.len() as u64, blocks);
        assert!(
            map_chunks(
                ["CPU", "GPU"],
                4,
                8,
                &chunks[..n - 1],
                blocks as usize,
                skip,
                &mut out
            )
            .is_err()
                || n == 0
        );
    }
}
