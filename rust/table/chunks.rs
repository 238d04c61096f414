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
