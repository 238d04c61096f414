//! The cell plan of the staged slab (see the parent module): a group's geometry and block
//! entries written as its blocks come ([`stage_cell_group`]), then the clusters of blocks whose
//! cells overlap laid in the ring and their host rows joined ([`finish_cells`]).

use super::{
    block_span, host_first, sort_entries, staged_cell, staged_pages, StagedCursor,
    STAGED_TABLE_EXTRA,
};
use crate::descriptor::{Columns, Prepared, Scratch};
use crate::table::{check_ids, Overlap, Pair, TableError};

/// Writes one group of a transfer on the cell plan (see the module's documentation) at `cursor`:
/// checks its ids as [`crate::table::expand_into`] does, writes its geometry (holes as segments of GPU
/// base 0) or reuses an equal one written before, and a block entry per block pair `(GPU block
/// id, host address of its first page, table at)`. [`finish_cells`] turns the host addresses into
/// ring offsets and writes the rows once every group is in. The host side must have a
/// [`staged_cell`].
pub fn stage_cell_group(
    pair: Pair<'_>,
    host_src: bool,
    out: Columns<'_>,
    cursor: &mut StagedCursor,
    scratch: &mut Scratch,
) -> Result<Prepared, TableError> {
    check_ids(pair, scratch)?;
    let (host, host_ids, gpu, gpu_ids) = host_first(pair, host_src);
    let (span, _) = staged_cell(host).ok_or_else(|| {
        TableError::BadChunking(
            "the staged plan needs a host table whose blocks' pages lie in one cell".into(),
        )
    })?;
    let segments = host.segments();
    let holes = (1..segments)
        .filter(|&s| host.bases[s] != host.bases[s - 1] + host.nbytes[s - 1])
        .count();
    let n = host_ids.len();
    let table = cursor.table;
    assert!(
        cursor.block + n <= cursor.rows + cursor.blocks
            && table + segments + holes + STAGED_TABLE_EXTRA <= out.src.len(),
        "slab too small"
    );
    let mut bitmask = span;
    let mut max_size = 0u64;
    let mut at = table + 1;
    // The pages' tile: where every page is as large as the first and each lies one gap after
    // the one before, that gap (0 otherwise), so that `finish_cells` joins a whole cell's
    // sub-blocks as one row without a page at a time.
    let mut tile = if segments > 1 {
        host.bases[1] - host.bases[0]
    } else {
        0
    };
    for s in 0..segments {
        let offset = host.bases[s] - host.bases[0];
        if host.nbytes[s] != host.nbytes[0] || (s > 0 && host.bases[s] - host.bases[s - 1] != tile)
        {
            tile = 0;
        }
        if s > 0 {
            let end = host.bases[s - 1] + host.nbytes[s - 1] - host.bases[0];
            if end != offset {
                (out.src[at], out.dst[at], out.size[at]) = (0, 0, end);
                at += 1;
            }
        }
        if gpu.bases[s] == 0 {
            return Err(TableError::BadSegment {
                segment: s,
                reason: "a GPU page at address 0".into(),
            });
        }
        bitmask |= gpu.bases[s] | gpu.strides[s] | host.nbytes[s] | offset;
        max_size = max_size.max(host.nbytes[s]);
        (out.src[at], out.dst[at], out.size[at]) = (gpu.bases[s], gpu.strides[s], offset);
        at += 1;
    }
    let page_bytes: u64 = host.nbytes.iter().sum();
    (out.src[table], out.dst[table], out.size[table]) = ((at - table - 1) as u64, tile, page_bytes);
    (out.src[at], out.dst[at], out.size[at]) = (0, 0, span);
    let len = at + 1 - table;
    // Groups with equal geometries (the sub-blocks of one chunk, pages of one size) share one,
    // so that a step's blocks launch the kernel once.
    let first_table = cursor.rows + cursor.blocks;
    let mut t = first_table;
    let mut geometry = table;
    while t < table {
        let l = out.src[t] as usize + STAGED_TABLE_EXTRA;
        if l == len
            && out.src[t..t + l] == out.src[table..table + len]
            && out.dst[t..t + l] == out.dst[table..table + len]
            && out.size[t..t + l] == out.size[table..table + len]
        {
            geometry = t;
            break;
        }
        t += l;
    }
    if geometry == table {
        cursor.table = table + len;
    }
    for (&hi, &gi) in host_ids.iter().zip(gpu_ids) {
        // In range by `check_ids`; the spans were proven not to overflow at registration.
        let b = cursor.block;
        (out.src[b], out.dst[b], out.size[b]) =
            (gi, host.bases[0] + hi * host.strides[0], geometry as u64);
        cursor.block += 1;
    }
    Ok(Prepared {
        len: n,
        bytes: page_bytes * n as u64,
        max_size,
        alignment: 1u64 << (bitmask | max_size).trailing_zeros().min(4),
        staged_rows: 0,
        staged_blocks_at: 0,
        staged_blocks: 0,
    })
}

/// Completes a cell plan's slab once [`stage_cell_group`] wrote every group: sorts the block
/// entries by host address, joins blocks whose spans overlap into clusters laid in the ring one
/// after the other, each as it lies on the host (no larger than `slot` bytes), sets each block
/// entry's ring offset, and writes as rows exactly the bytes the clusters' pages cover, joined
/// where they touch. On a store (`host_src` false) two pages that share a host byte are refused
/// (`table`: the host table's name), on a load they are read once. Returns the rows written.
pub fn finish_cells(
    out: Columns<'_>,
    cursor: &mut StagedCursor,
    host_src: bool,
    slot: u64,
    table: &str,
    scratch: &mut Scratch,
) -> Result<usize, TableError> {
    let Columns { src, dst, size } = out;
    let blocks = cursor.rows..cursor.block;
    sort_entries([src, dst, size], blocks.clone(), false);
    let pages = &mut scratch.pairs;
    let (mut row, mut ring) = (0usize, 0u64);
    let mut i = blocks.start;
    while i < blocks.end {
        // A cluster: the blocks from `i` whose spans overlap the cluster so far.
        let start = dst[i];
        let mut end = start + block_span(src, size, i);
        let mut j = i + 1;
        while j < blocks.end && dst[j] < end {
            end = end.max(dst[j] + block_span(src, size, j));
            j += 1;
        }
        if end - start > slot {
            return Err(TableError::BadChunking(format!(
                "the blocks of one cell span {} bytes, more than a staging slot (stage_bytes = \
                 {slot})",
                end - start
            )));
        }
        let rows = &mut scratch.rows;
        let geometry = size[i];
        // One geometry (the sub-blocks of a chunk): page by page, each across the blocks, which
        // is the host's order where the blocks' pages interleave as a cell's do. Where the
        // blocks lie a page apart (a chunk's sub-blocks), a segment's pages across them are one
        // run, joined as one. Joined as they come, without listing them.
        let streamed = size[i..j].iter().all(|&t| t == geometry) && {
            let t = geometry as usize;
            let hosts = &dst[i..j];
            let m = hosts.len() as u64;
            let gap = hosts.get(1).map(|&h| h - hosts[0]);
            let even = hosts.windows(2).all(|w| Some(w[1] - w[0]) == gap);
            let mut joining = Rows::new(rows, host_src);
            // Every sub-block of a tiled cell (see `stage_cell_group`): the segments' runs
            // touch, one row from the first page to the last run's end.
            let (tile, page) = (dst[t], size[t + 2] - size[t + 1]);
            let joined = if tile != 0 && even && gap == Some(page) && m * page == tile {
                // The last page lies a page before the block's span ends.
                let last = block_span(src, size, i) - page;
                joining.push((hosts[0], last + tile))
            } else {
                (t + 1..t + 1 + src[t] as usize)
                    .filter(|&s| src[s] != 0)
                    .try_for_each(|s| {
                        let (offset, bytes) = (size[s], size[s + 1] - size[s]);
                        if m == 1 || (even && gap == Some(bytes)) {
                            joining.push((hosts[0] + offset, bytes * m))
                        } else {
                            hosts
                                .iter()
                                .try_for_each(|&host| joining.push((host + offset, bytes)))
                        }
                    })
            };
            if joined.is_ok() {
                joining.finish();
            }
            joined.is_ok()
        };
        // Several geometries, pages out of order, or two that share a byte: every page listed
        // and sorted (which names two that share a byte as a check of the sorted pages does).
        let joined = if streamed {
            Ok(())
        } else {
            pages.clear();
            for b in i..j {
                // The entry's ring side still holds the host address of its first page.
                pages.extend(staged_pages(src, dst, size, b).map(|(a, _, bytes)| (a, bytes)));
            }
            pages.sort_unstable();
            Rows::join(pages, rows, host_src)
        };
        if let Err(Unjoined::Overlap(first, second)) = joined {
            return Err(TableError::OverlappingDestinations {
                table: table.to_string(),
                first,
                second,
                within: Overlap::Groups,
            });
        }
        for d in &mut dst[i..j] {
            *d = ring + (*d - start);
        }
        assert!(row + rows.len() <= cursor.rows, "slab too small");
        for &(addr, bytes) in rows.iter() {
            (src[row], dst[row], size[row]) = (addr, ring + (addr - start), bytes);
            row += 1;
        }
        ring += end - start;
        i = j;
    }
    cursor.row = row;
    cursor.ring = ring;
    Ok(row)
}

/// Why [`Rows::push`] stopped.
#[derive(Debug)]
enum Unjoined {
    /// A page came before the one before it.
    OutOfOrder,
    /// On a store, two pages share a host byte: `(address, bytes)` of each.
    Overlap((u64, u64), (u64, u64)),
}

/// Host rows joined from pages `(host address, bytes)` given in host order (by address, then
/// bytes): exactly the bytes they cover, a row `(address, bytes)` per run of pages that touch or
/// overlap. A store (`host_src` false) refuses two pages that share a byte, naming them as they
/// follow each other (which is how a check of the sorted pages names them); a load reads such
/// bytes once.
struct Rows<'a> {
    out: &'a mut Vec<(u64, u64)>,
    host_src: bool,
    /// The page before (or the run of pages joined as one).
    last: (u64, u64),
    /// `(address, end)` of the row being joined, from the first page on.
    row: Option<(u64, u64)>,
}

impl<'a> Rows<'a> {
    fn new(out: &'a mut Vec<(u64, u64)>, host_src: bool) -> Self {
        out.clear();
        Rows {
            out,
            host_src,
            last: (0, 0),
            row: None,
        }
    }

    fn push(&mut self, page: (u64, u64)) -> Result<(), Unjoined> {
        let (a, n) = page;
        let Some((addr, end)) = &mut self.row else {
            (self.row, self.last) = (Some((a, a + n)), page);
            return Ok(());
        };
        if page < self.last {
            return Err(Unjoined::OutOfOrder);
        } else if a <= *end {
            if a < *end && !self.host_src {
                return Err(Unjoined::Overlap(self.last, page));
            }
            *end = (*end).max(a + n);
        } else {
            self.out.push((*addr, *end - *addr));
            self.row = Some((a, a + n));
        }
        self.last = page;
        Ok(())
    }

    fn finish(self) {
        if let Some((addr, end)) = self.row {
            self.out.push((addr, end - addr));
        }
    }

    /// The rows of `pages`, sorted.
    fn join(
        pages: &[(u64, u64)],
        out: &mut Vec<(u64, u64)>,
        host_src: bool,
    ) -> Result<(), Unjoined> {
        let mut rows = Rows::new(out, host_src);
        pages.iter().try_for_each(|&p| rows.push(p))?;
        rows.finish();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{Rows, Unjoined};
    use proptest::prelude::*;

    fn join(pages: &[(u64, u64)], host_src: bool) -> Result<Vec<(u64, u64)>, Unjoined> {
        let mut out = vec![(1, 1)]; // cleared first
        Rows::join(pages, &mut out, host_src).map(|()| out)
    }

    #[test]
    fn rows_join_pages_that_touch_and_keep_gaps() {
        let pages = [(0, 16), (16, 16), (48, 8), (56, 8), (100, 4)];
        assert_eq!(join(&pages, false).unwrap(), [(0, 32), (48, 16), (100, 4)]);
        // Pages that share bytes: a load reads them once, a store names the two.
        let shared = [(0, 16), (8, 16), (24, 8)];
        assert_eq!(join(&shared, true).unwrap(), [(0, 32)]);
        assert!(matches!(
            join(&shared, false),
            Err(Unjoined::Overlap((0, 16), (8, 16)))
        ));
        // A page before the one before it stops the join.
        let mut out = Vec::new();
        let mut rows = Rows::new(&mut out, true);
        rows.push((32, 8)).unwrap();
        assert!(matches!(rows.push((16, 8)), Err(Unjoined::OutOfOrder)));
    }

    proptest! {
        /// Sorted pages become exactly the bytes they cover, in the fewest rows; a store is
        /// refused exactly where two pages share a byte.
        #[test]
        fn rows_are_the_bytes_the_pages_cover(
            mut pages in proptest::collection::vec((0u64..64, 1u64..8), 1..24),
            host_src in any::<bool>(),
        ) {
            pages.sort_unstable();
            let mut covered = [0u8; 72];
            for &(a, n) in &pages {
                for b in a..a + n {
                    covered[b as usize] += 1;
                }
            }
            match join(&pages, host_src) {
                Ok(rows) => {
                    prop_assert!(host_src || covered.iter().all(|&c| c <= 1));
                    let mut from_rows = [false; 72];
                    for w in rows.windows(2) {
                        prop_assert!(w[0].0 + w[0].1 < w[1].0, "rows apart: {:?}", rows);
                    }
                    for &(a, n) in &rows {
                        from_rows[a as usize..(a + n) as usize].fill(true);
                    }
                    for b in 0..72 {
                        prop_assert_eq!(from_rows[b], covered[b] > 0);
                    }
                }
                Err(Unjoined::Overlap(first, second)) => {
                    prop_assert!(!host_src);
                    prop_assert!(second.0 < first.0 + first.1 && first.0 <= second.0);
                }
                Err(Unjoined::OutOfOrder) => prop_assert!(false, "sorted pages out of order"),
            }
        }
    }
}
