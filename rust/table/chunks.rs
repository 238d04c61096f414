//! Chunk ids: a side whose table counts chunks of `unit` blocks (a CPU block of GPU-sized
//! sub-blocks) named by chunk ids, mapped to the table blocks a transfer moves.

use super::{BlockTable, TableError};
use crate::descriptor::Side;

/// The table blocks a transfer of `blocks` blocks names by chunk ids on one side: a chunk is
/// `table.unit` consecutive table blocks (a CPU block of GPU-sized sub-blocks), and the transfer
/// uses `blocks` consecutive sub-blocks of the listed chunks, in order, starting `skip`
/// sub-blocks into the first; the last chunk may be partial too. So `chunks.len()` must be
/// `ceil((skip + blocks) / unit)` (none for no block). Chunk ids are checked in range before they
/// are scaled; the table blocks are written to `out`.
pub fn chunk_blocks(
    table: &BlockTable,
    side: Side,
    other: &BlockTable,
    chunks: &[u64],
    blocks: usize,
    skip: u64,
    out: &mut Vec<u64>,
) -> Result<(), TableError> {
    let (name, unit) = (table.label(side), table.unit);
    let other_side = match side {
        Side::Src => Side::Dst,
        Side::Dst => Side::Src,
    };
    let names = [name.as_str(), &other.label(other_side)];
    map_chunks(
        names,
        unit,
        table.num_blocks / unit,
        chunks,
        blocks,
        skip,
        out,
    )
}

/// Sub-blocks a transfer of `blocks` blocks skips in its first chunk of `unit`: from the first
/// block's index in its request where it is known (`block_index % unit`, vLLM's
/// `block_indices`); without it, a store starts at its first chunk's start (0) and a load ends
/// at its last chunk's end (`(-blocks) mod unit`).
#[must_use]
pub fn chunk_skip(unit: u64, blocks: u64, block_index: Option<u64>, store: bool) -> u64 {
    let unit = unit.max(1);
    match block_index {
        Some(index) => index % unit,
        None if store => 0,
        None => (unit - blocks % unit) % unit,
    }
}

/// Chunks of `unit` a transfer of `blocks` blocks names from sub-block `skip` of the first:
/// `ceil((skip + blocks) / unit)`, none for no block.
#[must_use]
pub fn chunk_count(unit: u64, blocks: u64, skip: u64) -> u64 {
    if blocks == 0 {
        0
    } else {
        skip.saturating_add(blocks).div_ceil(unit.max(1))
    }
}

/// [`chunk_blocks`] without tables: chunks of `unit` blocks, `num_chunks` of them; `names`: what
/// errors call the chunks' blocks and the other side's.
pub fn map_chunks(
    names: [&str; 2],
    unit: u64,
    num_chunks: u64,
    chunks: &[u64],
    blocks: usize,
    skip: u64,
    out: &mut Vec<u64>,
) -> Result<(), TableError> {
    let name = names[0].to_string();
    if unit == 0 || skip >= unit {
        return Err(TableError::BadChunking(format!(
            "a skip of {skip} sub-blocks into the first {name} block, which holds {unit}: the \
             skip must be below {unit}"
        )));
    }
    if chunks.len() as u64 != chunk_count(unit, blocks as u64, skip) {
        return Err(TableError::ChunkCount {
            name,
            other: names[1].to_string(),
            blocks,
            unit,
            skip,
            got: chunks.len(),
        });
    }
    // Checked before scaling: no chunk id wraps into a valid block.
    let limit = num_chunks.min(u64::MAX / unit);
    if let Some(index) = chunks.iter().position(|&c| c >= limit) {
        return Err(TableError::OutOfRange {
            name,
            index,
            id: chunks[index] as i64,
            num_blocks: num_chunks,
        });
    }
    out.clear();
    out.reserve(blocks);
    let (mut first, mut left) = (skip, blocks as u64);
    for &c in chunks {
        // No overflow: `c < u64::MAX / unit`.
        let take = (unit - first).min(left);
        let b = c * unit + first;
        out.extend(b..b + take);
        left -= take;
        first = 0;
    }
    Ok(())
}

/// One piece of a connector's spec cut by [`cut_spec`]: a group's blocks that go to one pair of
/// tables, with their GPU block ids, their CPU ids (chunk ids, or with `skip` the chunks of a
/// table that counts them) and the sub-blocks skipped in the first chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecPiece {
    /// The group, and the pair among its tables.
    pub group: usize,
    pub pair: usize,
    pub gpu: Vec<u64>,
    pub cpu: Vec<u64>,
    /// `Some(skip)` where the pair's CPU table counts chunks of `unit` blocks (one pair for the
    /// group): its chunk ids as given. `None` where it does not.
    pub skip: Option<u64>,
}

/// A connector's transfer spec (vLLM's: GPU block ids and CPU chunk ids as flat lists, each
/// group's blocks after the previous group's; per group its block count in `sizes` and its
/// first block's index in its request in `starts`) cut into the pieces that go to each group's
/// table pairs (`pairs[g]`, the number of pairs of group `g`), chunks of `unit` blocks:
///
/// - no pair: the group has no pages, and must name no block;
/// - one pair: the group's blocks and chunk ids whole, its CPU table counting chunks (`skip`
///   from [`chunk_skip`] where `unit` > 1);
/// - `unit` pairs: pair `j` holds sub-block `j` of every chunk (a chunk's pages laid cell by
///   cell, each tensor's sub-blocks after each other, as vLLM's shared region lays them): the
///   block at sub-block position `p = skip + i` goes to pair `p % unit` with chunk id
///   `chunks[p / unit]`, in the order of the spec. Empty pieces are left out.
///
/// Each group takes [`chunk_count`] chunks; the groups together must take every id the spec
/// names. Errors say which count is wrong.
pub fn cut_spec(
    gpu: &[u64],
    cpu: &[u64],
    sizes: &[u64],
    starts: &[u64],
    pairs: &[usize],
    unit: u64,
) -> Result<Vec<SpecPiece>, TableError> {
    let bad = |msg: String| Err(TableError::BadChunking(msg));
    if unit == 0 {
        return bad("a chunk of 0 blocks".into());
    }
    if sizes.len() != pairs.len() || starts.len() != pairs.len() {
        let groups = pairs.len();
        return bad(format!(
            "the spec has {} group sizes and {} block indices for {groups} KV-cache group{}",
            sizes.len(),
            starts.len(),
            if groups == 1 { "" } else { "s" },
        ));
    }
    // Every count first: the slices below stay inside the spec's lists.
    let (mut blocks, mut chunks) = (0u64, 0u64);
    let mut spans = Vec::with_capacity(sizes.len());
    for (g, ((&n, &start), &p)) in sizes.iter().zip(starts).zip(pairs).enumerate() {
        if p == 0 && n > 0 {
            return bad(format!(
                "group {g} has no pages but the spec names {n} blocks"
            ));
        }
        if p != 1 && p as u64 != unit && p != 0 {
            return bad(format!(
                "group {g} has {p} table pairs: one, or one per sub-block of a chunk ({unit})"
            ));
        }
        let skip = chunk_skip(unit, n, Some(start), false);
        let m = chunk_count(unit, n, skip);
        spans.push((skip, blocks, chunks, n, m));
        blocks = blocks.saturating_add(n);
        chunks = chunks.saturating_add(m);
    }
    if blocks != gpu.len() as u64 || chunks != cpu.len() as u64 {
        return bad(format!(
            "the groups take {blocks} GPU blocks and {chunks} CPU chunks, the spec names {} \
             and {}",
            gpu.len(),
            cpu.len()
        ));
    }
    let mut out = Vec::new();
    for (g, (&(skip, o, c, n, m), &p)) in spans.iter().zip(pairs).enumerate() {
        if n == 0 {
            continue;
        }
        // In range: the totals equal the lists' lengths, so each group's span fits in usize.
        let ids = &gpu[o as usize..(o + n) as usize];
        let cs = &cpu[c as usize..(c + m) as usize];
        if p == 1 {
            out.push(SpecPiece {
                group: g,
                pair: 0,
                gpu: ids.to_vec(),
                cpu: cs.to_vec(),
                skip: (unit > 1).then_some(skip),
            });
            continue;
        }
        for j in 0..unit {
            // The first block at sub-block `j` of its chunk, and that chunk.
            let first = ((j + unit - skip) % unit) as usize;
            let gj: Vec<u64> = ids
                .iter()
                .skip(first)
                .step_by(unit as usize)
                .copied()
                .collect();
            if gj.is_empty() {
                continue;
            }
            // In range: the last block, `first + (len - 1) * unit`, is below `n`, so its chunk
            // `(skip + first) / unit + len - 1` is below `ceil((skip + n) / unit) = m`.
            let c0 = ((skip + first as u64) / unit) as usize;
            let cj = cs[c0..c0 + gj.len()].to_vec();
            out.push(SpecPiece {
                group: g,
                pair: j as usize,
                gpu: gj,
                cpu: cj,
                skip: None,
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Block `i` of each group at sub-block position `skip + i` of its chunks: the pair and chunk
    /// each block goes to, worked out one block at a time.
    fn by_block(
        gpu: &[u64],
        cpu: &[u64],
        sizes: &[u64],
        starts: &[u64],
        pairs: &[usize],
        unit: u64,
    ) -> Vec<(usize, usize, u64, u64)> {
        let (mut o, mut c) = (0usize, 0usize);
        let mut out = Vec::new();
        for (g, (&n, &start)) in sizes.iter().zip(starts).enumerate() {
            let skip = start % unit;
            for i in 0..n {
                let pos = skip + i;
                let pair = if pairs[g] == 1 {
                    0
                } else {
                    (pos % unit) as usize
                };
                out.push((g, pair, gpu[o + i as usize], cpu[c + (pos / unit) as usize]));
            }
            o += n as usize;
            c += chunk_count(unit, n, skip) as usize;
        }
        out.sort_unstable();
        out
    }

    #[test]
    fn pieces_hold_every_block_once_at_its_sub_block() {
        for unit in 1..=5u64 {
            for (sizes, starts, pairs) in [
                (vec![7u64], vec![0u64], vec![unit as usize]),
                (vec![7, 3], vec![3, 1], vec![unit as usize, unit as usize]),
                (
                    vec![1, 0, 9],
                    vec![unit + 2, 0, 5],
                    vec![unit as usize, 0, unit as usize],
                ),
                (vec![4, 6], vec![1, 2], vec![1, unit as usize]),
            ] {
                let blocks: u64 = sizes.iter().sum();
                let chunks: u64 = sizes
                    .iter()
                    .zip(&starts)
                    .map(|(&n, &s)| chunk_count(unit, n, s % unit))
                    .sum();
                let gpu: Vec<u64> = (0..blocks).map(|i| 1000 + 7 * i).collect();
                let cpu: Vec<u64> = (0..chunks).map(|i| 50 + 3 * i).collect();
                let pieces = cut_spec(&gpu, &cpu, &sizes, &starts, &pairs, unit).unwrap();
                let mut got = Vec::new();
                for p in &pieces {
                    assert!(!p.gpu.is_empty());
                    if let Some(skip) = p.skip {
                        // One pair: the chunk ids as given, the skip from the block index.
                        assert_eq!(pairs[p.group], 1);
                        assert!(unit > 1);
                        assert_eq!(skip, starts[p.group] % unit);
                        let mut sub = Vec::new();
                        map_chunks(
                            ["c", "g"],
                            unit,
                            1 << 20,
                            &p.cpu,
                            p.gpu.len(),
                            skip,
                            &mut sub,
                        )
                        .unwrap();
                        got.extend(p.gpu.iter().zip(&sub).map(|(&b, &s)| {
                            (
                                p.group,
                                0,
                                b,
                                cpu[cpu.iter().position(|&c| c == s / unit).unwrap()],
                            )
                        }));
                    } else {
                        assert_eq!(p.gpu.len(), p.cpu.len());
                        got.extend(
                            p.gpu
                                .iter()
                                .zip(&p.cpu)
                                .map(|(&b, &c)| (p.group, p.pair, b, c)),
                        );
                    }
                }
                got.sort_unstable();
                let want = by_block(&gpu, &cpu, &sizes, &starts, &pairs, unit);
                assert_eq!(got, want, "unit {unit}, sizes {sizes:?}, starts {starts:?}");
            }
        }
    }

    #[test]
    fn counts_that_do_not_match_are_named() {
        let err = |r: Result<Vec<SpecPiece>, TableError>| match r {
            Err(TableError::BadChunking(m)) => m,
            other => panic!("{other:?}"),
        };
        let m = err(cut_spec(&[1, 2, 3], &[0, 1], &[3], &[0], &[4], 4));
        assert!(
            m.contains("take 3 GPU blocks and 1 CPU chunks, the spec names 3 and 2"),
            "{m}"
        );
        // Block index 3: the three blocks cross into a second chunk.
        let m = err(cut_spec(&[1, 2, 3], &[0], &[3], &[3], &[4], 4));
        assert!(
            m.contains("the groups take 3 GPU blocks and 2 CPU chunks, the spec names 3 and 1"),
            "{m}"
        );
        let m = err(cut_spec(&[1], &[0], &[1, 0], &[0], &[4, 4], 4));
        assert!(m.contains("2 group sizes and 1 block indices for 2"), "{m}");
        let m = err(cut_spec(&[1], &[0], &[1], &[0], &[0], 4));
        assert!(
            m.contains("group 0 has no pages but the spec names 1 blocks"),
            "{m}"
        );
        let m = err(cut_spec(&[1], &[0], &[1], &[0], &[3], 4));
        assert!(m.contains("group 0 has 3 table pairs"), "{m}");
        // Counts that would overflow are refused, not wrapped.
        let m = err(cut_spec(&[1], &[0], &[u64::MAX, 2], &[0, 0], &[1, 1], 1));
        assert!(m.contains("the groups take"), "{m}");
        assert!(cut_spec(&[], &[], &[], &[], &[], 0).is_err());
    }
}
